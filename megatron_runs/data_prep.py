"""JSONL text → BPE tokenizer + Megatron indexed dataset (.bin/.idx), built offline and cached.

`prepare(None, …)` builds the demo corpus from the Python standard library's sources on this
machine (code and docstrings: real text, no download). The result lives in a directory named
by a fingerprint of the input and vocabulary size, written to a temporary directory and
renamed into place, so a finished dataset is never half-written and a second call is free.
Concurrent callers (several ranks, several test processes) serialize on a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import platform
import shutil
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EOD = "<|endoftext|>"
FORMAT_VERSION = 1
DEMO_MAX_BYTES = 6_000_000


@dataclass(frozen=True)
class PreparedData:
    prefix: str
    tokenizer_path: str


def stdlib_sources(max_bytes: int = DEMO_MAX_BYTES) -> list[Path]:
    """The demo corpus: sorted stdlib .py files (tests excluded) up to max_bytes in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    picked, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idle_test", "site-packages") for p in rel):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        picked.append(path)
        total += size
    return picked


def _fingerprint(input_jsonl: Path | None, vocab_size: int) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}:{vocab_size}".encode())
    if input_jsonl is None:
        # The demo corpus is this interpreter's standard library: named by where it lives and
        # which Python it is, not by walking it (0.5 s in every rank at every start).
        stdlib = sysconfig.get_paths()["stdlib"]
        h.update(f"{stdlib}:{platform.python_version()}:{DEMO_MAX_BYTES}".encode())
    else:
        st = input_jsonl.stat()
        h.update(f"{input_jsonl.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _documents(input_jsonl: Path | None) -> Iterator[str]:
    if input_jsonl is None:
        for p in stdlib_sources():
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text
        return
    with input_jsonl.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{input_jsonl}:{n}: expected a JSON object with 'text'") from exc
            if text:
                yield text


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(input_jsonl: Path | None, out_dir: Path, vocab_size: int) -> PreparedData:
    """Tokenize `input_jsonl` (or the stdlib demo corpus) into `out_dir/<fingerprint>/`."""
    out_dir = Path(out_dir)
    name = "demo" if input_jsonl is None else Path(input_jsonl).stem
    final = out_dir / f"{name}-{_fingerprint(input_jsonl, vocab_size)}"
    result = PreparedData(
        prefix=str(final / "text_document"), tokenizer_path=str(final / "tokenizer.json")
    )
    if (final / "manifest.json").exists():
        return result
    with _locked(out_dir / ".prepare.lock"):
        if (final / "manifest.json").exists():
            return result
        tmp = out_dir / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        stats = _build(list(_documents(input_jsonl)), tmp, vocab_size)
        (tmp / "manifest.json").write_text(json.dumps({"vocab_size": vocab_size, **stats}))
        tmp.rename(final)
    return result


def halves(prepared: PreparedData) -> list[str]:
    """The prepared dataset's documents in two indexed datasets (even and odd ones), beside it:
    two prefixes for a `data.blend` (the demo's, the tests'). Written once, atomically."""
    final = Path(prepared.prefix).parent / "halves"
    prefixes = [str(final / f"half{part}") for part in (0, 1)]
    if final.exists():
        return prefixes
    with _locked(final.parent / ".halves.lock"):
        if final.exists():
            return prefixes
        import numpy as np

        from megatron_runs.cpu_compat import stub_triton_kernels

        stub_triton_kernels()  # importing megatron.core needs it where triton is absent
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

        source = IndexedDataset(prepared.prefix)
        tmp = final.parent / ".tmp-halves"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for part in (0, 1):
            builder = IndexedDatasetBuilder(str(tmp / f"half{part}.bin"), dtype=source.index.dtype)
            for i in range(part, len(source), 2):
                doc = np.asarray(source[i])
                builder.add_document(doc, [len(doc)])
            builder.finalize(str(tmp / f"half{part}.idx"))
        tmp.rename(final)
    return prefixes


def _build(docs: list[str], out: Path, vocab_size: int) -> dict[str, int]:
    import numpy as np

    from megatron_runs.cpu_compat import stub_triton_kernels

    stub_triton_kernels()  # importing megatron.core needs it where triton is absent
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not docs:
        raise ValueError("no documents to prepare")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    eod = tok.token_to_id(EOD)
    dtype = np.uint16 if vocab_size < 65_000 else np.int32
    builder = IndexedDatasetBuilder(str(out / "text_document.bin"), dtype=dtype)
    n_tokens = 0
    for enc in tok.encode_batch(docs):
        ids = [*enc.ids, eod]
        builder.add_document(ids, [len(ids)])
        n_tokens += len(ids)
    builder.finalize(str(out / "text_document.idx"))
    return {"documents": len(docs), "tokens": n_tokens, "eod": eod}
