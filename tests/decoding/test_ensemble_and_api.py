"""Ensembles, the Python API and translate.py's output formats (issue 61).

An ensemble's step is the log of the models' mean probability (fairseq's EnsembleModel);
greedy search over it is checked against a loop that runs each model on the whole prefix.
``Translator.translate`` is the documented Python API; ``tinytf.train`` trains from Python
and logs through the standard ``logging`` module.
"""
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinytf
from tinytf import functional as F
from tinytf.decoding.ensemble import EnsembleTranslator, mean_probability_log
from tinytf.decoding.translation import SearchOptions, TranslationError, Translator, pad_sources
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.text import BOS_ID, BPE, EOS_ID
from tinytf.utils import checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "data" / "ende"
LINES = ["Good morning.", "The child is playing in the garden.", "", "I like tea."]


def _run(tmp_path, bpe, seed):
    run = tmp_path / f"run{seed}"
    run.mkdir()
    bpe.save(str(run / "bpe.json"))
    tinytf.manual_seed(seed)
    config = TransformerConfig(vocab_size=len(bpe), d_model=32, n_heads=4, d_ff=64,
                               n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=64)
    meta = {"model_config": config.to_dict(),
            "bpe": {"file": "bpe.json", "sha256": checkpoint.sha256_file(run / "bpe.json")}}
    checkpoint.CheckpointManager(str(run)).save(1, Transformer(config).state_dict(), None, meta)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of one BPE (different weights) and a run of another BPE."""
    tmp = tmp_path_factory.mktemp("ens")
    text = (DATA / "train.en").read_text().splitlines()[:200] + \
        (DATA / "train.de").read_text().splitlines()[:200]
    bpe = BPE.learn(text, vocab_size=350)
    other = BPE.learn(text[:150] + text[200:350], vocab_size=350)
    return _run(tmp, bpe, 1), _run(tmp, bpe, 2), _run(tmp, other, 3)


def test_mean_probability_log_is_the_log_of_the_mean_probability():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 7)) * 3
    logp = [np.log(np.exp(z) / np.exp(z).sum(-1, keepdims=True)) for z in logits]
    got = mean_probability_log([a.astype(np.float32) for a in logp])
    want = np.log(np.mean([np.exp(a) for a in logp], axis=0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, rtol=1e-5)
    banned = [np.array([[-np.inf, 0.0]]), np.array([[-np.inf, 0.0]])]
    assert mean_probability_log(banned)[0, 0] == -np.inf


def _greedy_by_hand(models, src, steps):
    """Greedy decoding of the ensemble, each model on the whole prefix at every step."""
    prefix = np.full((len(src), 1), BOS_ID)
    for _ in range(steps):
        probs = np.mean([np.exp(F.log_softmax(m(src, prefix)[:, -1]).numpy().astype(np.float64))
                         for m in models], axis=0)
        probs[:, :3] = 0                                   # pad, bos, unk banned, as the search
        prefix = np.concatenate([prefix, probs.argmax(-1)[:, None]], axis=1)
    return prefix[:, 1:]


def test_greedy_ensemble_equals_the_mean_probability_by_hand(runs):
    ensemble = EnsembleTranslator.load_all([str(runs[0]), str(runs[1])])
    sources = ensemble.encode_lines(["Good morning.", "The child is here."])
    options = SearchOptions(beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=5)
    hyps = ensemble.translate_ids(sources, options)
    with tinytf.no_grad():
        expected = _greedy_by_hand([m.model for m in ensemble.members], pad_sources(sources), 6)
    for hyp, row in zip(hyps, expected):
        tokens = list(hyp[0].tokens)
        n = len(tokens)
        assert tokens == list(row[:n]), (tokens, row)
        assert n == 5 or row[n] == EOS_ID     # it stopped where </s> won, or at max_len_b


def test_an_ensemble_of_one_model_twice_translates_as_the_model(runs):
    single = Translator.load(str(runs[0]))
    twice = EnsembleTranslator.load_all([str(runs[0]), str(runs[0])])
    assert twice.translate(LINES, beam=3) == single.translate(LINES, beam=3)


def test_an_ensemble_of_two_bpe_models_is_refused(runs):
    with pytest.raises(TranslationError, match="different BPE models"):
        EnsembleTranslator.load_all([str(runs[0]), str(runs[2])])


def test_python_api_shapes(runs):
    t = tinytf.Translator.load(str(runs[0]))
    out = t.translate(LINES)
    assert isinstance(out, list) and all(isinstance(x, str) for x in out) and out[2] == ""
    assert t.translate(LINES[0]) == out[0]
    assert out == [n[0][0] for n in t.translate_lines(LINES, SearchOptions())]
    two = t.translate(LINES[:2], beam=4, nbest=2)
    assert len(two) == 2 and all(len(n) == 2 and isinstance(n[0], str) for n in two)
    scored = t.translate(LINES[0], beam=4, nbest=3, with_scores=True)
    assert len(scored) == 3 and all(isinstance(s, float) for _, s in scored)
    assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)
    assert t.translate(LINES[:1], beam=1) == t.translate(LINES[:1], beam=1)
    with pytest.raises(ValueError, match="nbest"):
        t.translate("x", beam=2, nbest=3)
    with pytest.raises(TypeError, match="string"):
        t.translate([1, 2])


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, str(ROOT / "translate.py"), *map(str, args)],
                          input=stdin, capture_output=True, cwd=ROOT, timeout=300)


def test_cli_ensemble_jsonl_and_tsv(runs, tmp_path):
    src = tmp_path / "in.en"
    src.write_text("\n".join(LINES) + "\n")
    proc = run_cli("--model", runs[0], runs[1], "--input", src, "--output-format", "jsonl",
                   "--nbest", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [d["line"] for d in docs] == [1, 2, 3, 4]
    assert [d["source"] for d in docs] == LINES
    assert all(len(d["nbest"]) == (2 if d["source"] else 1)    # an empty line: one, empty
               and d["translation"] == d["nbest"][0]["translation"] for d in docs)
    ensemble = EnsembleTranslator.load_all([str(runs[0]), str(runs[1])])
    assert [d["translation"] for d in docs] == ensemble.translate(LINES)
    proc = run_cli("--model", runs[0], "--input", src, "--output-format", "tsv", "--quiet")
    rows = [line.split("\t") for line in proc.stdout.decode().splitlines()]
    assert len(rows) == 4 and all(len(r) == 3 for r in rows)
    assert math.isfinite(float(rows[0][1])) and float(rows[0][2]) <= 0


def test_cli_reference_line_count_is_checked_before_decoding(runs, tmp_path):
    src, ref, out = tmp_path / "in.en", tmp_path / "ref.de", tmp_path / "out.de"
    src.write_text("\n".join(LINES) + "\n")
    ref.write_text("eins\nzwei\n")
    proc = run_cli("--model", runs[0], "--input", src, "--reference", ref, "--output", out)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip().endswith(f"{ref}: 2 reference lines for 4 input lines "
                                                 f"in {src}")
    assert not out.exists()                 # refused before the output was opened


def test_cli_ensemble_refuses_what_takes_one_model(runs, tmp_path):
    proc = run_cli("--model", runs[0], runs[1], "--score-reference", tmp_path / "x")
    assert proc.returncode == 2 and b"take one --model" in proc.stderr


def test_train_from_python_logs_through_logging(data_dir, tmp_path, caplog, capsys):
    from train_support import TINY
    overrides = dict(s.split("=") for s in TINY)
    model = {k: (float(v) if "." in v else int(v)) for k, v in overrides.items()
             if k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                      "dropout", "max_len")}
    with caplog.at_level(logging.INFO, logger="tinytf"):
        summary = tinytf.train(data=data_dir, out=str(tmp_path / "py"), max_steps=2,
                               vocab_size=300, max_tokens=200, model_overrides=model,
                               train_max_len=40, optimizer="adam", test_bleu=False,
                               valid_bleu_sentences=2)
    assert summary["steps"] == 2 and "checkpoint" in json.dumps(summary)
    messages = [r.getMessage() for r in caplog.records if r.name == "tinytf.train"]
    assert any(m.startswith("training tiny") for m in messages), messages[:3]
    assert capsys.readouterr().err == ""        # nothing on stderr unless logging says so
    assert tinytf.Translator.load(str(tmp_path / "py")).translate("Good morning.")
    with pytest.raises(tinytf.training.config.TrainError, match="unknown option 'max_step'"):
        tinytf.train(max_step=3)
    with pytest.raises(tinytf.training.config.TrainError,   # a recipe option, by name
                       match="--budget-min-updates must not be negative"):
        tinytf.train(min_updates=-1, max_steps=1)


def test_log_format_json_is_one_object_per_line(data_dir, tmp_path, capsys):
    from train_support import TINY, _train_main
    code, _, err = _train_main(capsys, "--data", data_dir, "--out", str(tmp_path / "j"),
                               "--max-steps", "2", "--log-interval", "1", "--vocab-size",
                               "300", "--max-tokens", "200", "--log-format", "json",
                               "--set", "test_bleu=false",
                               *[a for s in TINY for a in ("--set", s)])
    assert code == 0, err
    docs = [json.loads(line) for line in err.strip().splitlines()]
    assert any("message" in d and d["message"].startswith("training tiny") for d in docs)
    assert any(d.get("step") == 2 and "loss" in d and "lr" in d for d in docs)


def test_tensorboard_scalars(data_dir, tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    from train_support import TINY, _train_main
    code, _, err = _train_main(capsys, "--data", data_dir, "--out", str(tmp_path / "tb"),
                               "--max-steps", "2", "--log-interval", "1", "--vocab-size",
                               "300", "--max-tokens", "200", "--tensorboard",
                               str(tmp_path / "events"), "--set", "test_bleu=false",
                               *[a for s in TINY for a in ("--set", s)])
    assert code == 0, err
    from tensorboardX.proto.event_pb2 import Event
    files = list((tmp_path / "events").glob("events.out.tfevents.*"))
    assert len(files) == 1
    data, tags = files[0].read_bytes(), set()
    while data:                             # TFRecords: length, its CRC, the event, its CRC
        n = int.from_bytes(data[:8], "little")
        event = Event.FromString(data[12:12 + n])
        tags |= {(v.tag, event.step) for v in event.summary.value}
        data = data[16 + n:]
    assert {("train/loss", 1), ("train/loss", 2), ("train/lr", 2)} <= tags, sorted(tags)


def test_a_terminal_gets_a_prompt(runs):
    """Standard input on a terminal: a hint and a "> " prompt on stderr, each sentence
    answered at once; Ctrl-D ends. Piped input gets neither (the other tests)."""
    import os
    import pty
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--model",
                             str(runs[0])], stdin=secondary, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    os.close(secondary)
    os.write(primary, b"Good morning.\n")
    line = proc.stdout.readline()
    os.write(primary, b"\x04")                 # Ctrl-D: the end of the input
    out, err = proc.communicate(timeout=120)
    os.close(primary)
    assert proc.returncode == 0, err
    expected = Translator.load(str(runs[0])).translate("Good morning.")
    assert line.decode().rstrip("\n") == expected
    assert b"type a sentence and Enter to translate it; Ctrl-D ends" in err
    assert err.count(b"> ") >= 2
