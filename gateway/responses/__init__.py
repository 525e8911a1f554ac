"""OpenAI's Responses API (`/v1/responses`): a request becomes a chat body served by the chat
pipeline; its answer is written back as Responses output, and stored for `previous_response_id`."""
