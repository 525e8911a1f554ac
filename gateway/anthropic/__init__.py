"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a request becomes a chat
body served by the chat pipeline, and chat's answer is written back in the Messages shape."""
