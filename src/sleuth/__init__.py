"""sleuth: train and run LLM search agents (AceSearcher, ExSearch, s3, ARENA) on one tested core."""

from sleuth.records import Example, Passage, Step, Trace

__version__ = "0.1.0"
__all__ = ["Example", "Passage", "Step", "Trace", "__version__"]
