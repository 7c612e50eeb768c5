"""Benchmark datasets as :class:`~sleuth.records.Example` objects: loaders, format detection, open-mode corpora.

See :mod:`sleuth.data.loaders` for the formats and the choices made for each.
"""

from sleuth.data._rows import DatasetError, passage_id, read_records
from sleuth.data.claims import load_fever, load_hover, load_strategyqa, strategyqa_paragraphs
from sleuth.data.loaders import (
    LOADERS,
    detect_format,
    format_of_record,
    iter_examples,
    load_examples,
    open_corpus,
    write_open_corpus,
)
from sleuth.data.medical import load_medqa, load_pubmedqa
from sleuth.data.multihop import load_2wiki, load_bamboogle, load_flashrag, load_hotpotqa, load_ircot, load_musique
from sleuth.data.numeric import load_docmath, load_gsm8k, load_tatqa

__all__ = [
    "LOADERS",
    "DatasetError",
    "detect_format",
    "format_of_record",
    "iter_examples",
    "load_2wiki",
    "load_bamboogle",
    "load_docmath",
    "load_examples",
    "load_fever",
    "load_flashrag",
    "load_gsm8k",
    "load_hotpotqa",
    "load_hover",
    "load_ircot",
    "load_medqa",
    "load_musique",
    "load_pubmedqa",
    "load_strategyqa",
    "load_tatqa",
    "open_corpus",
    "passage_id",
    "read_records",
    "strategyqa_paragraphs",
    "write_open_corpus",
]
