"""OpenAI's `/v1/completions` and `/v1/chat/completions`: routes, request validation -> GenerationSpec,
and the reply (whole or streamed), which the Responses and Messages APIs translate from."""
