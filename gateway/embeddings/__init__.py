"""Embeddings: OpenAI's `/v1/embeddings` and TEI's `/embed`, one prefill-only job per request, and
how this model pools its hidden states."""
