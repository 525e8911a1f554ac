"""Output parsers for chat answers: reasoning (`reasoning`: think blocks) and tool calls
(`tool_calls`: one class per model family's format), each streaming (`feed` / `finish`)."""
