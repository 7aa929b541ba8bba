"""Hypothesis mutates valid files at random: a checkpoint (its bytes, and its members'
bytes re-zipped with fresh checksums), a bpe.json and a prepared corpus's header. Each
mutant loads, or is refused with the reader's own error naming the file; never another
exception, and never an allocation beyond what the (small) file holds."""
import contextlib
import io
import json
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinytf
from tinytf.data import corpus_file
from tinytf.decoding.translation import TranslationError, Translator
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.text import BPE, BPEFileError
from tinytf.utils import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINES = open(os.path.join(ROOT, "data", "ende", "train.en"), encoding="utf-8").read() \
    .splitlines()[:100]
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """(run directory, checkpoint bytes, bpe.json bytes) of a tiny untrained model."""
    run = tmp_path_factory.mktemp("valid")
    bpe = BPE.learn(LINES, vocab_size=280)
    bpe.save(str(run / "bpe.json"))
    tinytf.manual_seed(1)
    config = TransformerConfig(vocab_size=len(bpe), d_model=8, n_heads=2, d_ff=16,
                               n_encoder_layers=1, n_decoder_layers=1, max_len=32)
    checkpoint.save(run / "model.npz", Transformer(config).state_dict(),
                    meta={"model_config": config.to_dict(), "step": 1,
                          "format": checkpoint.FORMAT})
    return run, (run / "model.npz").read_bytes(), (run / "bpe.json").read_bytes()


def _mutate(data: bytes, edits) -> bytes:
    """``data`` with each (position fraction, replacement bytes, delete count) applied, or
    truncated where the replacement is None."""
    out = bytearray(data)
    for where, new, drop in edits:
        at = int(where * len(out))
        if new is None:
            del out[at:]
        else:
            out[at:at + drop] = new
    return bytes(out)


def _members(data: bytes) -> dict:
    """{name: bytes} of the zip archive ``data``."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _zip(path, members: dict):
    """``members`` written as the zip archive ``path`` (fresh checksums); returns it."""
    with zipfile.ZipFile(path, "w") as z:
        for key, value in members.items():
            z.writestr(key, value)
    return path


EDITS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                           st.one_of(st.none(), st.binary(min_size=1, max_size=8)),
                           st.integers(0, 8)), min_size=1, max_size=4)


PEAK = 64 << 20
"""The most a mutant of a file of some 30 KB may make the reader allocate (tracemalloc
counts NumPy's arrays too): a claim in the file is checked before it is believed."""


@contextlib.contextmanager
def within_peak(path):
    """The block allocates less than :data:`PEAK` bytes (reading ``path``)."""
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK, f"{path}: loading allocated {peak:,} bytes"


def _load(path, run):
    """Translator.load of ``path`` with the run's BPE: a model, or the readers' refusals;
    either way within :data:`PEAK` bytes."""
    with within_peak(path):
        try:
            return Translator.load(str(path))
        except (TranslationError, BPEFileError, checkpoint.CheckpointError) as e:
            assert str(path) in str(e) or str(run) in str(e), e
            return None


@SETTINGS
@given(edits=EDITS)
def test_a_mutated_checkpoint_loads_or_is_refused(valid, tmp_path, edits):
    run, data, _ = valid
    path = run / "mutant.npz"
    path.write_bytes(_mutate(data, edits))
    _load(path, run)


@SETTINGS
@given(member=st.integers(0, 1000), edits=EDITS)
def test_a_checkpoint_with_a_mutated_member_loads_or_is_refused(valid, member, edits):
    """The member's bytes change but the archive's checksums are right: the headers and
    the metadata are what is tested, not zip's CRC."""
    run, data, _ = valid
    members = _members(data)
    name = sorted(members)[member % len(members)]
    members[name] = _mutate(members[name], edits)
    _load(_zip(run / "member-mutant.npz", members), run)


@SETTINGS
@given(edits=EDITS)
def test_a_mutated_bpe_file_loads_or_is_refused(valid, tmp_path, edits):
    _, _, data = valid
    path = tmp_path / "bpe.json"
    path.write_bytes(_mutate(data, edits))
    with within_peak(path):
        try:
            BPE.load(str(path))
        except BPEFileError as e:
            assert str(path) in str(e)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


@SETTINGS
@given(key=st.sampled_from(["pairs", "src_tokens", "tgt_tokens", "dtype", "max_len", "lines",
                            "skipped_long", "skipped_empty", "format", "version"]),
       value=JSON)
def test_a_corpus_header_with_a_field_of_any_value_is_stale_or_opens(tmp_path_factory, key,
                                                                     value):
    """A prepared corpus whose header field ``key`` is replaced by any JSON value: either
    stale_reason names what is wrong, or the corpus opens and its pairs read back."""
    path = tmp_path_factory.mktemp("corpus") / "corpus"
    src = [np.array([5, 6, 7]), np.array([8])]
    tgt = [np.array([9, 10]), np.array([11, 12, 13])]
    with corpus_file.CorpusWriter(str(path), vocab_size=100) as w:
        w.add(np.concatenate(src), np.array([3, 1]), np.concatenate(tgt), np.array([2, 3]),
              np.array([0, 1]))
        w.finish({"bpe_sha256": "x", "max_len": 16, "sources": [], "lines": 2,
                  "skipped_long": 0, "skipped_empty": 0})
    header_path = os.path.join(path, corpus_file.HEADER)
    header = json.load(open(header_path))
    header[key] = value
    json.dump(header, open(header_path, "w"))
    reason = corpus_file.stale_reason(str(path), "x", [], 16)
    if reason is None:
        corpus = corpus_file.open_corpus(str(path))
        assert len(corpus) == 2


def test_a_member_whose_header_is_not_python_literal_is_refused(valid):
    """Found by the test above: NumPy reads an .npy header with ast.literal_eval, which a
    NUL byte or an unclosed bracket makes raise SyntaxError or TokenError, not ValueError."""
    run, data, _ = valid
    members = _members(data)
    name = next(k for k in sorted(members) if k.startswith("model/"))
    for header in (b"{'descr': '<f4', \x00", b"{'descr': ['<f4', "):
        members[name] = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
        path = _zip(run / "forged-header.npz", members)
        with pytest.raises(checkpoint.CheckpointError, match="not a NumPy array"):
            checkpoint.load(path)
