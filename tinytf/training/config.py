"""What a training run is asked to do: :class:`TrainConfig`, its per-preset defaults, the
``--set`` overrides, and :class:`TrainError` for problems the user can fix.

``train.py`` builds a :class:`TrainConfig` from its flags; :meth:`TrainConfig.resolved`
fills what was left unset from the preset's defaults (``PRESET_DEFAULTS``: the ``tiny``
recipe of docs/training.md, the paper's for the others) and checks the combination.
"""
from __future__ import annotations

import dataclasses
import json
import os

try:
    import tomllib
except ImportError:                 # Python 3.10: no TOML reader in the standard library
    tomllib = None

from tinytf.models.transformer import TransformerConfig
from tinytf.nn import amp
from tinytf.optim.schedule import LINEAR_WARMUP_CAP, SCHEDULES, Schedule
from tinytf.training import recipes
from tinytf.training.recipes.presets import PRESET_DEFAULTS

BPE_FILE = "bpe.json"
CORPUS_DIR = "corpus"   # RUNDIR/corpus: the encoded training pairs (tinytf.data.corpus_file)


OPTIMIZERS = ("adam", "radam")
"""--optimizer: Adam(0.9, 0.98, 1e-9), the paper's; or the same with RAdam's rectifier
(``tinytf.optim.adam.Adam(rectify=True)``)."""


class TrainError(RuntimeError):
    """A problem the user can fix (bad option, run directory, resume mismatch, divergence);
    train.py prints the message without a traceback."""


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainConfig:
    """Every option of a training run; stored in full in each checkpoint.

    Options left at None are filled in by :meth:`resolved` from ``PRESET_DEFAULTS`` (the
    ``tiny`` preset gets settings that learn something in 10 minutes on 2 CPU cores; the
    others get the paper's). ``model_overrides`` holds ``--set`` keys of
    :class:`TransformerConfig`, ``recipe_options`` those of the preset's recipe
    (:mod:`tinytf.training.recipes`), which this class knows only as a dict.
    """

    data: str = "data/ende"
    src: str = "en"
    tgt: str = "de"
    train_files: list | None = None   # [source file, target file]: any names (--train)
    valid_files: list | None = None   # the dev pair (--valid), with train_files
    test_files: list | None = None    # the test pair (--test), optional
    out: str | None = None            # default: runs/<data dir name>-<config>
    config: str = "tiny"              # preset of TransformerConfig (--preset)
    model_overrides: dict = dataclasses.field(default_factory=dict)
    recipe_options: dict = dataclasses.field(default_factory=dict)  # the recipe's own (recipes/)
    max_tokens: int | None = None     # padded tokens per batch and side, per rank
    update_freq: int = 1              # batches accumulated per update
    max_steps: int | None = None      # stop after this many updates (0/None: no limit)
    max_minutes: float | None = None  # stop after this wall time (0/None: no limit)
    lr_schedule: str | None = None    # noam | inverse_sqrt | linear (tinytf.optim.schedule)
    lr: float | None = None           # peak learning rate (inverse_sqrt, linear)
    warmup: int | None = None
    lr_factor: float | None = None    # factor of the paper's schedule (noam)
    optimizer: str | None = None      # adam | radam (Adam with RAdam's rectifier: optim.adam)
    vocab_size: int | None = None     # joint BPE pieces (specials and 256 bytes included)
    seed: int = 1
    resume: bool = False
    device: str = "cpu"
    precision: str = "float32"        # float32 | tf32 | bf16 | fp16 (tinytf.nn.amp)
    cuda_graph: bool = False          # replay steps as CUDA graphs (GPU; fast.cuda.graph)
    log_interval: int = 10
    log_format: str = "text"          # the progress on stderr: text lines or JSON objects
    tensorboard: str | None = None    # a directory for TensorBoard scalars (tensorboardX)
    save_interval: int | None = None  # steps between checkpoints
    valid_interval: int | None = None  # steps between validations (default: save_interval)
    keep_last: int = 5
    clip_norm: float = 0.0            # 0: no clipping (the paper clips nothing)
    train_max_len: int = 128          # pairs with a longer side (tokens + </s>) are skipped
    valid_bleu_sentences: int = 200   # periodic dev BLEU on the first N dev pairs (0: all)
    test_bleu: bool = True            # decode test.SRC at the end if it exists
    test_beam: int = 4                # beam size of the final test decoding (1: greedy only)
    valid_samples: int = 3            # sample translations logged at every validation
    max_bad_steps: int = 5            # stop after this many non-finite steps in a row
    dropout_from_epoch: int | None = None  # the model's dropout acts from this epoch on (1: all)
    max_epochs: int | None = None     # stop after this many passes over the training data
    patience: int = 0                 # stop after N validations without a better best_metric
    best_metric: str = "loss"         # checkpoint_best.npz and patience: dev "loss" or "bleu"
    init_from: str | None = None      # a new run starts from this run's / checkpoint's weights
    workers: int | None = None        # processes that learn the BPE / encode the text (None: CPUs)

    PRESET_DEFAULTS = PRESET_DEFAULTS   # per preset, the options it fills in (recipes/presets.py)

    def resolved(self) -> "TrainConfig":
        """A copy with every None default filled in (preset-dependent) and checked."""
        defaults = self.preset_defaults()
        cfg = dataclasses.replace(self, model_overrides=dict(self.model_overrides),
                                  recipe_options=recipes.resolve_options(self, defaults))
        cfg._resolve_schedule(defaults)
        for key, value in defaults.items():
            if key not in ("lr", "lr_factor", "recipe") and getattr(cfg, key) is None:
                setattr(cfg, key, value)
        if cfg.out is None:
            cfg.out = os.path.join("runs", f"{cfg.data_name()}-{cfg.config}")
        if cfg.valid_interval is None:
            cfg.valid_interval = cfg.save_interval
        if not cfg.max_steps and not cfg.max_minutes and not cfg.max_epochs:
            cfg.max_minutes = 10.0  # never run unbounded by accident; documented in --help
        cfg.check()
        return cfg

    def data_name(self) -> str:
        """The data's short name for the default run directory: the --data directory's
        name, or with --train the source file's name without its suffix."""
        if self.train_files:
            return os.path.splitext(os.path.basename(self.train_files[0]))[0] or "data"
        return os.path.basename(os.path.normpath(self.data))

    def preset_defaults(self) -> dict:
        """The training defaults of this run's preset."""
        return self.PRESET_DEFAULTS.get(self.config, self.PRESET_DEFAULTS["default"])

    def _resolve_schedule(self, defaults: dict) -> None:
        """Choose the schedule from what the user set: ``--lr-factor`` alone asks for the
        paper's schedule (noam), ``--lr`` alone for a schedule with that peak (the preset's
        own, or inverse_sqrt where the preset's is noam); otherwise the preset's."""
        if self.lr_schedule is None:
            if self.lr_factor is not None and self.lr is not None:
                raise TrainError("--lr (a peak) and --lr-factor (the factor of the paper's "
                                 "schedule) exclude each other; pass --lr-schedule too to say "
                                 "which schedule is meant")
            if self.lr_factor is not None:
                self.lr_schedule = "noam"
            elif self.lr is not None and defaults["lr_schedule"] == "noam":
                self.lr_schedule = "inverse_sqrt"
            else:
                self.lr_schedule = defaults["lr_schedule"]
        if self.lr_schedule not in SCHEDULES:
            raise TrainError(f"--lr-schedule {self.lr_schedule!r}: choose from "
                             f"{', '.join(SCHEDULES)}")
        if self.lr_schedule == "noam":
            if self.lr is not None:
                raise TrainError("--lr sets the peak of inverse_sqrt or linear; the paper's "
                                 "schedule (noam) takes --lr-factor")
            if self.lr_factor is None:
                self.lr_factor = defaults.get("lr_factor", 1.0)
        else:
            if self.lr_factor is not None:
                raise TrainError(f"--lr-factor is the factor of the paper's schedule (noam); "
                                 f"--lr-schedule {self.lr_schedule} takes its peak as --lr")
            if self.lr is None:
                self.lr = defaults["lr"] if "lr" in defaults else self.tuned_peak()

    def _model_value(self, key: str):
        """The model key's value: --set's, else the preset's, else TransformerConfig's."""
        return {**TransformerConfig.PRESETS.get(self.config, {}),
                **self.model_overrides}.get(key, getattr(TransformerConfig, key))

    def tuned_peak(self) -> float:
        """The peak learning rate that this preset's defaults give (what it was tuned for)."""
        d = self.preset_defaults()
        if d["lr_schedule"] == "noam":
            return d["lr_factor"] * (self._model_value("d_model") * d["warmup"]) ** -0.5
        return d["lr"]

    def schedule(self) -> Schedule:
        """The :class:`tinytf.optim.schedule.Schedule` of this (resolved) config."""
        if self.lr_schedule == "noam":
            return Schedule("noam", self.warmup, factor=self.lr_factor,
                            d_model=self._model_value("d_model"))
        return Schedule(self.lr_schedule, self.warmup, peak=self.lr)

    def schedule_warning(self) -> str | None:
        """A warning when the peak is far (over 3x) from what the preset was tuned for."""
        peak, tuned = self.schedule().peak_lr, self.tuned_peak()
        if tuned / 3 <= peak <= tuned * 3:
            return None
        how = (" (the paper's schedule ties its peak to --warmup and d_model; --lr "
               "sets a peak directly)" if self.lr_schedule == "noam" else "")
        return (f"warning: peak learning rate {peak:.2e} is {peak / tuned:.2g}x the "
                f"{tuned:.2e} that the {self.config} preset was tuned for{how}")

    SHORT_WARMUP = 0.15   # linear: a warm-up ending before this share of the budget is short

    def warmup_warning(self, expected_updates: int | None) -> str | None:
        """A warning when the ``linear`` schedule's warm-up, set shorter than the preset's,
        ends before `SHORT_WARMUP` of the budget's `expected_updates` (None: no budget
        known): the peak was tuned with the warm-up at its cap, 30 % of the budget, and at
        the main job's budget `--warmup 100` (5 %) reached 0.76-0.90x of the default
        warm-up's beam 4 BLEU with QK-norm (0.90x with the preset's dropout from epoch 3)
        and 0.62-0.77x without, as two-seed means (docs/experiments/2026-12-tiny-recipe.md,
        "QK-norm" and "Late dropout"). The preset's own warm-up (4,000 updates) never warns,
        however long the budget; nor does RAdam (``--optimizer radam``, the tiny preset's),
        whose rectifier damps the early updates by itself: with it `--warmup 100` reached
        0.90x of the default warm-up's mean beam 4 in the 10-minute grid and 0.98x in step
        budgets, three seeds each (docs/training.md, "RAdam")."""
        if (self.lr_schedule != "linear" or not expected_updates or self.optimizer == "radam"
                or self.warmup >= self.preset_defaults()["warmup"]):
            return None
        if self.warmup >= self.SHORT_WARMUP * expected_updates:
            return None     # (a warm-up at its cap, 30 % of the budget, is never short)
        qk = "" if self._model_value("qk_norm") else "--set qk_norm=true, "
        return (f"warning: the warm-up ends after {self.warmup} of the budget's about "
                f"{expected_updates} updates ({self.warmup / expected_updates:.0%}); the peak "
                f"{self.lr:.2e} was tuned with the warm-up at {LINEAR_WARMUP_CAP:.0%} of the "
                f"budget, and a warm-up this short learns less "
                f"(docs/experiments/2026-12-tiny-recipe.md, \"QK-norm\"): "
                f"{qk}--optimizer radam, a longer --warmup, or a lower --lr with it, learns "
                f"more")

    def check(self) -> None:
        """Raise TrainError for values that cannot work."""
        if self.config not in TransformerConfig.PRESETS:
            raise TrainError(f"--preset {self.config!r}: choose from "
                             f"{sorted(TransformerConfig.PRESETS)}")
        for key in ("train_files", "valid_files", "test_files"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, (list, tuple)) or len(value) != 2
                                      or not all(isinstance(v, str) for v in value)):
                raise TrainError(f"{option_of(key)} takes two files, source and target; "
                                 f"got {value!r}")
        if bool(self.train_files) != bool(self.valid_files):
            raise TrainError("--train and --valid go together: the training pair and the dev "
                             "pair that validation scores")
        if self.test_files and not self.train_files:
            raise TrainError("--test goes with --train and --valid (with --data, test.SRC and "
                             "test.TGT are found in the directory)")
        if self.device not in ("cpu", "gpu"):
            raise TrainError(f"--device {self.device!r}: choose cpu or gpu")
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"--optimizer {self.optimizer!r}: choose from "
                             f"{', '.join(OPTIMIZERS)}")
        if self.precision not in amp.PRECISIONS:
            raise TrainError(f"--precision {self.precision!r}: choose from "
                             f"{', '.join(amp.PRECISIONS)}")
        if self.cuda_graph and self.device != "gpu":
            raise TrainError("--cuda-graph replays steps as CUDA graphs: it needs --device gpu")
        positive = ("max_tokens", "update_freq", "warmup", "vocab_size", "log_interval",
                    "save_interval", "valid_interval", "train_max_len", "max_bad_steps",
                    "workers", "dropout_from_epoch")
        for key in positive:
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise TrainError(f"{option_of(key)} must be at least 1, got "
                                 f"{getattr(self, key)}")
        for key in ("lr_factor", "lr"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise TrainError(f"{option_of(key)} must be positive, got {getattr(self, key)}")
        if self.log_format not in ("text", "json"):
            raise TrainError(f"--log-format {self.log_format!r}: choose text or json")
        if self.best_metric not in ("loss", "bleu"):
            raise TrainError(f"--best-metric {self.best_metric!r}: choose loss or bleu")
        for key in ("max_steps", "max_minutes", "clip_norm", "keep_last", "max_epochs",
                    "patience", "valid_bleu_sentences", "valid_samples", "test_beam"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise TrainError(f"{option_of(key)} must not be negative, got "
                                 f"{getattr(self, key)}")
        problem = recipes.check_options(self.recipe_options)
        if problem:
            raise TrainError(f"{option_of(problem[0])} {problem[1]}")

    def to_dict(self) -> dict:
        """JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)


FLAGS = frozenset((
    "data", "src", "tgt", "train_files", "valid_files", "test_files", "out", "config",
    "max_tokens", "update_freq",
    "max_steps", "max_minutes", "lr_schedule", "lr", "warmup", "lr_factor", "optimizer",
    "vocab_size", "seed", "resume", "device", "precision", "cuda_graph", "log_interval",
    "save_interval", "valid_interval", "keep_last", "clip_norm", "max_epochs", "patience",
    "best_metric", "valid_samples", "init_from", "workers", "log_format", "tensorboard"))
"""The options that ``train.py`` has a flag for (``--max-tokens``), each parsed into the
field of its name; the rest are set with ``--set key=value``."""


FLAG_NAMES = {"config": "--preset", "min_updates": "--budget-min-updates",
              "save_interval": "--save-interval-updates",
              "valid_interval": "--validate-interval-updates", "train_files": "--train",
              "valid_files": "--valid", "test_files": "--test"}
"""The flags whose name is not their field's (``--preset`` sets ``config``)."""


def option_of(key: str) -> str:
    """How a user sets option ``key`` on the command line, for messages: its flag
    (``--max-tokens``), or ``--set train_max_len``."""
    if key in FLAG_NAMES:
        return FLAG_NAMES[key]
    return "--" + key.replace("_", "-") if key in FLAGS else f"--set {key}"


CONFIG_FILE_LIMIT = 1 << 20
"""A --config file larger than this (1 MiB) is refused before it is parsed."""

NOT_FROM_FILE = ("resume",)
"""Keys of a run's config.json that a --config file does not carry over: a file starts a
new run (and a fitted batch is fitted again: :func:`recipes.for_new_run`)."""


def read_config_file(path: str) -> dict:
    """The options in JSON or TOML file ``path`` (TOML when it ends in ``.toml``), with the
    keys of a run's ``config.json`` (or that file itself, whose "options" are read):
    {TrainConfig field: value}. Unknown keys, wrong types, a file too large or unparseable
    are a :class:`TrainError` naming the file."""
    try:
        size = os.path.getsize(path)
        if not os.path.isfile(path):
            raise TrainError(f"{path}: not a regular file (--config reads a JSON or TOML file)")
        if size > CONFIG_FILE_LIMIT:
            raise TrainError(f"{path}: {size:,} bytes; a --config file holds at most "
                             f"{CONFIG_FILE_LIMIT:,}")
        with open(path, "rb") as f:
            raw = f.read(CONFIG_FILE_LIMIT + 1)
    except OSError as e:
        raise TrainError(f"{path}: {e.strerror or e}") from None
    try:
        if path.endswith(".toml"):
            if tomllib is None:
                raise TrainError(f"{path}: reading TOML needs Python 3.11 (tomllib); "
                                 "give the options as JSON")
            values = tomllib.loads(raw.decode("utf-8"))
        else:
            values = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TrainError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise TrainError(f"{path}: line {e.lineno}: {e.msg}") from None
    except ValueError as e:        # tomllib.TOMLDecodeError
        raise TrainError(f"{path}: {e}") from None
    except RecursionError:
        raise TrainError(f"{path}: nested too deeply") from None
    if not isinstance(values, dict):
        raise TrainError(f"{path}: expected an object of options (the keys of a run's "
                         f"config.json), got {type(values).__name__}")
    if isinstance(values.get("options"), dict) and "command" in values:
        values = values["options"]      # a run's own config.json: its options
    return _checked_options(path, values)


def _checked_options(path: str, values: dict) -> dict:
    """``values`` without the keys a file does not carry, each checked against its field's
    type (the defaults' types, or the presets' where the default is None)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values = recipes.from_legacy(values)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TrainError(f"{path}: unknown option {unknown[0]!r} (the keys are those of a "
                         f"run's config.json: {', '.join(sorted(fields))})")
    options = {}
    for key, value in values.items():
        if key in NOT_FROM_FILE or value is None:
            continue
        kind = str(fields[key].type).split(" | ")[0]      # "int | None" -> "int"
        if kind == "list":
            ok = isinstance(value, list) and len(value) == 2 and \
                all(isinstance(v, str) for v in value)
        elif kind == "dict":
            ok = isinstance(value, dict) and all(
                isinstance(v, (int, float, str, bool)) for v in value.values())
        elif kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise TrainError(f"{path}: option {key!r} has the wrong type "
                             f"({type(value).__name__}: {str(value)[:40]!r})")
        options[key] = value
    if "model_overrides" in options:
        model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        bad = sorted(set(options["model_overrides"]) - model_fields)
        if bad:
            raise TrainError(f"{path}: model_overrides: unknown model key {bad[0]!r}")
    if "recipe_options" in options:
        options["recipe_options"] = recipes.for_new_run(options["recipe_options"])
        problem = recipes.check_options(options["recipe_options"])
        if problem:
            raise TrainError(f"{path}: recipe_options: {problem[0]} {problem[1]}")
    return options


def _parse_value(text: str, current, key: str):
    """Parse ``--set`` text to the type of the field's current value."""
    if isinstance(current, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise TrainError(f"--set {key}={text}: expected true or false")
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        kind = "an integer" if isinstance(current, int) else "a number"
        raise TrainError(f"--set {key}={text}: expected {kind}") from None
    return text


def apply_overrides(cfg: TrainConfig, assignments) -> TrainConfig:
    """Apply ``--set key=value`` assignments: model keys (TransformerConfig fields) go to
    ``cfg.model_overrides``, the recipe's options to ``cfg.recipe_options``, other
    TrainConfig fields are set directly; an unknown key is an error listing the known ones
    (a typo must never be silently ignored)."""
    model_fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {
        "model_overrides", "recipe_options"}
    base_model = TransformerConfig()
    cfg = dataclasses.replace(cfg, model_overrides=dict(cfg.model_overrides),
                              recipe_options=dict(cfg.recipe_options))
    for item in assignments:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise TrainError(f"--set {item!r}: expected key=value")
        if key in model_fields:
            cfg.model_overrides[key] = _parse_value(text, getattr(base_model, key), key)
        elif key in recipes.OPTION_DEFAULTS:
            cfg.recipe_options[key] = _parse_value(text, recipes.OPTION_DEFAULTS[key], key)
        elif key in train_fields:
            current = getattr(cfg, key)
            if current is None:  # an unresolved default: take the type from the preset value
                current = TrainConfig.PRESET_DEFAULTS["default"].get(key, 0.0 if key in (
                    "max_minutes", "lr") else 0)
            setattr(cfg, key, _parse_value(text, current, key))
        else:
            raise TrainError(f"--set {key}: unknown key; model keys are "
                             f"{sorted(model_fields)}, training keys are "
                             f"{sorted(train_fields | set(recipes.OPTION_DEFAULTS))}")
    return cfg


def model_config_for(cfg: TrainConfig, vocab_size: int) -> TransformerConfig:
    """The preset with ``--set`` overrides, sized to the BPE vocabulary (and long enough for
    the longest training pair)."""
    overrides = {"vocab_size": vocab_size, **cfg.model_overrides}
    try:
        model_cfg = TransformerConfig.preset(cfg.config, **overrides)
    except (ValueError, TypeError) as e:
        raise TrainError(str(e)) from None
    if model_cfg.vocab_size < vocab_size:
        raise TrainError(f"--set vocab_size={model_cfg.vocab_size} is smaller than the BPE "
                         f"model's {vocab_size} pieces")
    if model_cfg.max_len < cfg.train_max_len:
        raise TrainError(f"model max_len={model_cfg.max_len} is shorter than "
                         f"train_max_len={cfg.train_max_len}")
    return model_cfg
