"""JSONL → BPE tokenizer + Megatron indexed dataset, cached by fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_runs.data_prep import prepare

REPO = Path(__file__).resolve().parents[2]

READ_BACK = """
import json, sys
from megatron_runs.cpu_compat import stub_triton_kernels
stub_triton_kernels()
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer
ds = IndexedDataset(sys.argv[1])
tok = Tokenizer.from_file(sys.argv[2])
docs = [ds[i].tolist() for i in range(len(ds))]
print(json.dumps({"n": len(docs), "eod": [d[-1] for d in docs], "first": tok.decode(docs[0][:-1])}))
"""


@pytest.mark.timeout(300)
def test_jsonl_becomes_an_indexed_dataset_and_is_cached(tmp_path: Path) -> None:
    texts = [f"def f{i}(x):\n    return x * {i}  # document number {i}\n" for i in range(40)]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    first = prepare(src, out, vocab_size=300)
    idx = Path(first.prefix + ".idx")
    stamp = idx.stat().st_mtime_ns
    assert prepare(src, out, vocab_size=300) == first and idx.stat().st_mtime_ns == stamp
    assert prepare(src, out, vocab_size=320).prefix != first.prefix
    got = subprocess.run(
        [sys.executable, "-c", READ_BACK, first.prefix, first.tokenizer_path],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=200,
    )
    read = json.loads(got.stdout.strip().splitlines()[-1])
    manifest = json.loads((Path(first.prefix).parent / "manifest.json").read_text())
    assert read["n"] == 40 == manifest["documents"]
    assert set(read["eod"]) == {manifest["eod"]}
    assert read["first"] == texts[0]


def test_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        prepare(src, tmp_path / "out", vocab_size=300)
