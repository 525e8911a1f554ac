"""text-generation-inference's API (`/generate`, `/generate_stream`, `POST /`): routes, request
validation -> GenerationSpec, and its part of /openapi.json, whose scalar `parameters` are written
from the table the validator checks them with."""
