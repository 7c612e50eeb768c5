"""Retrieval: one contract (``search(queries, k) -> list[list[Passage]]``) for every index kind."""

from sleuth.retrieval.base import RetrievalError, Retriever, load_retriever, read_manifest, register_retriever

__all__ = ["RetrievalError", "Retriever", "load_retriever", "read_manifest", "register_retriever"]
