"""Baton: disaggregated LLM serving. `from baton import LLM, SamplingParams` for offline use."""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: services that only need the protocol should not import torch.
    if name == "LLM":
        from baton.llm import LLM

        return LLM
    if name == "SamplingParams":
        from baton.common.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
