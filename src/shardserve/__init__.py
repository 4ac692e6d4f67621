"""shardserve: serve large language models split across many devices."""

from shardserve.core import RequestOutput
from shardserve.sampling_params import LoRARequest, SamplingParams
from shardserve.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so worker processes that import shardserve.* do not pay for the offline API's imports.
    if name == "LLM":
        from shardserve.llm import LLM

        return LLM
    raise AttributeError(name)
