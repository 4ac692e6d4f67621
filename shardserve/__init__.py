"""shardserve: serve large language models split across many devices."""

from shardserve.core import RequestOutput, SamplingParams
from shardserve.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
