"""Run options: every knob strata has lives here, checked once.

The CLI, `STRATA_*` environment variables and library callers all build these dataclasses;
everything below `cli.py` receives them whole and never re-reads the environment. Checkpoint
configuration (config.json) is parsed in model/config.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .model.config import DTYPE_NAMES, ConfigError
from .model.quant import GROUP_SIZES as QUANT_GROUP_SIZES
from .speculative.controller import CostPrior
from .speculative.suffix_drafter import DEFAULT_MIN_MATCH

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0
# float32's smallest normal (logits are float32): a temperature below it, whose reciprocal
# overflows and which below ~7e-46 rounds to 0, decodes greedily, the limit it tends to.
MIN_SAMPLING_TEMPERATURE = 2.0**-126
DEFAULT_SEED = 0
DEFAULT_REPETITION_CONTEXT = 20  # mlx-lm's repetition_context_size
MAX_SUFFIX_DRAFT = 7  # a window is root + drafts; T <= 8 is what every rollback rule is tested for
PREFILL_CHUNK = 512
FOLD_MODES = ("lazy", "eager")
CONVERT_BITS = (4, 8)  # what `strata convert --bits` writes (loading reads any affine width)
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class ConvertOptions:
    """What `strata convert` writes.

    Args:
        bits: quantize to this many bits per weight (4 or 8); None (default) = no quantization.
        group_size: weights sharing one scale and bias (32, 64 or 128; default 64). Only with `bits`.
        dtype: "float32", "bfloat16", "float16", or None (default) for the checkpoint's own.
        force: replace an existing destination (default False: refuse).
        stream: write the routed experts in the streaming layout (`experts/`, one aligned record
            per expert, experts/store.py) instead of safetensors (default False).
    """

    bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    dtype: str | None = None
    force: bool = False
    stream: bool = False

    def __post_init__(self):
        if self.bits is not None and self.bits not in CONVERT_BITS:
            raise ConfigError(f"bits must be one of {CONVERT_BITS}, got {self.bits!r}")
        if self.group_size not in QUANT_GROUP_SIZES:
            raise ConfigError(f"group_size must be one of {QUANT_GROUP_SIZES}, got {self.group_size!r}")
        if self.bits is None and self.group_size != DEFAULT_GROUP_SIZE:
            raise ConfigError(f"group_size ({self.group_size}) applies only with bits (quantization)")
        if self.dtype not in (None, *DTYPE_NAMES):
            raise ConfigError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")


COMPRESSED_ROLLBACK_MODES = ("replay", "cap")


@dataclass(frozen=True)
class EngineOptions:
    """How the window engine keeps and rolls back state.

    Args:
        fold: "lazy" (default) defers folding kept GDN rows into the recurrent state until the
            next window, where it joins that window's graph; "eager" folds at commit.
        partial: commit the root row inside `run` (it is always kept), so commit folds keep-1 rows.
        max_context: positions the engine may hold (prompt + generated); None = the model's maximum.
        compressed_rollback: how compressed-attention tails (DeepSeek-V4 CSA/HCA) roll back:
            "replay" (default: a window never changes the committed tail, commit rebuilds it from
            the kept rows, any window size is safe) or "cap" (rings written in place, windows
            capped at the compressor block, `T <= rate - pos0 % rate`).
        warm_shapes: True runs every window shape (the row buckets of T = 1..MAX_SUFFIX_DRAFT+1)
            once at load (`WindowEngine.warm_up`); None (default) warms each shape on first use
            instead, before the window that needs it and outside its timing, on GPU backends
            (nothing on the CPU, which builds nothing per shape); False never warms (a new shape
            is built inside the window that first runs it).
        pad_windows: run a window of T rows as its row bucket (1, 2, 4 or 8 rows: the extra rows
            repeat the last token, and are never kept), so four shapes serve every window;
            None (default) = on GPU backends with resident experts (a padded row of a streamed
            model would read experts), off on the CPU, where a row costs a row.
    """

    fold: str = "lazy"
    partial: bool = False
    max_context: int | None = None
    warm_shapes: bool | None = None
    pad_windows: bool | None = None
    compressed_rollback: str = "replay"

    def __post_init__(self):
        if self.fold not in FOLD_MODES:
            raise ConfigError(f"fold must be one of {FOLD_MODES}, got {self.fold!r}")
        if self.compressed_rollback not in COMPRESSED_ROLLBACK_MODES:
            raise ConfigError(f"compressed_rollback must be one of {COMPRESSED_ROLLBACK_MODES}, "
                              f"got {self.compressed_rollback!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be at least 2, got {self.max_context}")


EXPERT_PREFETCH_MODES = ("router", "history", "off")
DEFAULT_EXPERT_PREFETCH = "router"  # measured: docs/benchmarks.md, "Expert streaming"
EXPERT_IO_MODES = ("auto", "direct", "buffered")
DEFAULT_EXPERT_IO_THREADS = 8


@dataclass(frozen=True)
class StreamOptions:
    """How a streamed checkpoint's experts are cached and read (experts/).

    Args:
        cache_gb: expert cache budget in GB (10^9 bytes) over all MoE blocks; None = unset.
        resident_experts: resident experts per MoE block; None = unset. With neither budget set,
            every expert is resident once read.
        prefetch: "router" (default: the next block's router on this block's input), "history"
            (experts that followed these picks before) or "off".
        root_prefetch: only row 0 of a window drives prefetch; demand reads still serve every row.
        io: "auto" (default: O_DIRECT where allowed, else the page cache), "direct" or "buffered".
        io_threads: reader threads (default 8).
        verify: check each record's crc32 on read (default True).
        readahead_depth: demand reads first: at most this many read-aheads at the disk at once,
            none while a demand read is queued or running; the rest wait in strata's queue, where
            a layer that routes without them cancels them (experts/reads.py). None (default):
            every read goes to the reader threads as it comes.
        readahead_min_prob: router prefetch reads an expert only when some row's predicted
            router probability for it is at least this (default 0: every predicted pick).
    """

    cache_gb: float | None = None
    resident_experts: int | None = None
    prefetch: str = DEFAULT_EXPERT_PREFETCH
    root_prefetch: bool = False
    io: str = "auto"
    io_threads: int = DEFAULT_EXPERT_IO_THREADS
    verify: bool = True
    readahead_depth: int | None = None
    readahead_min_prob: float = 0.0

    def __post_init__(self):
        if self.cache_gb is not None and self.resident_experts is not None:
            raise ConfigError("give the expert budget once: --expert-cache GB or --resident-experts N, not both")
        if self.cache_gb is not None and not self.cache_gb > 0:
            raise ConfigError(f"expert cache must be > 0 GB, got {self.cache_gb}")
        if self.resident_experts is not None and self.resident_experts < 1:
            raise ConfigError(f"resident experts must be at least 1, got {self.resident_experts}")
        if self.prefetch not in EXPERT_PREFETCH_MODES:
            raise ConfigError(f"expert prefetch must be one of {EXPERT_PREFETCH_MODES}, got {self.prefetch!r}")
        if self.root_prefetch and self.prefetch == "off":
            raise ConfigError("root-only prefetch needs prefetch on (router or history), not 'off'")
        if self.io not in EXPERT_IO_MODES:
            raise ConfigError(f"expert io must be one of {EXPERT_IO_MODES}, got {self.io!r}")
        if self.io_threads < 1:
            raise ConfigError(f"expert io threads must be at least 1, got {self.io_threads}")
        if self.readahead_depth is not None and self.readahead_depth < 1:
            raise ConfigError(f"--expert-readahead-depth must be at least 1, got {self.readahead_depth}")
        if self.readahead_depth is not None and self.prefetch == "off":
            raise ConfigError("--expert-readahead-depth orders read-ahead behind demand reads; "
                              "it needs prefetch on (router or history), not 'off'")
        if not 0 <= self.readahead_min_prob < 1:  # also rejects NaN
            raise ConfigError(f"--expert-readahead-min-prob must be in [0, 1), got {self.readahead_min_prob}")
        if self.readahead_min_prob and self.prefetch != "router":
            raise ConfigError(f"--expert-readahead-min-prob gates router prefetch by its predicted probability; "
                              f"prefetch is {self.prefetch!r}, use --expert-prefetch router")

    @property
    def is_default(self) -> bool:
        return self == StreamOptions()


@dataclass(frozen=True)
class MoceOptions:
    """Cache-aware routing for streamed experts (MoCE): approximate, opt-in (experts/moce.py).

    Each token keeps its natural top-`protect` experts; its other top-k slots go to the experts
    with the highest router probability after multiplying resident experts' by exp(`bonus`).
    Rows 1..T-1 of a decode window (the drafts) use the draft knobs, row 0 the base ones.

    Args:
        protect: J, natural top experts every token keeps; None (default) = MoCE off, exact routing.
        bonus: B >= 0, the log-factor resident experts' probabilities get (default 0: exact picks).
        draft_protect: J for draft rows; None (default) = `protect`.
        draft_bonus: B for draft rows; None (default) = `bonus`.
        budget: most non-resident experts loaded per MoE layer per window beyond the protected
            ones, after which routing is restricted to residents; None (default) = no budget.
        exact_prefill: prompt chunks route exactly (default False: they use the base knobs). A
            chunk's union usually needs most experts anyway, so MoCE there saves few reads while
            its substitutions stay in every later token's context (docs/benchmarks.md).
        natural_prefetch: router prefetch reads the next layer's natural top-k, as with exact
            routing (default False: it predicts MoCE's own picks from the predicted router
            probabilities and the residency, so it does not read experts MoCE will replace).
        count_inflight: experts whose read is already in flight for the block being routed
            (read ahead, not yet resident) count as resident for the bonus, as their read is
            already paid for (default False: only resident experts get it).
    """

    protect: int | None = None
    bonus: float | None = None
    draft_protect: int | None = None
    draft_bonus: float | None = None
    budget: int | None = None
    exact_prefill: bool = False
    natural_prefetch: bool = False
    count_inflight: bool = False

    def __post_init__(self):
        knobs = {"--moce-bonus": self.bonus, "--draft-moce-protect": self.draft_protect,
                 "--draft-moce-bonus": self.draft_bonus, "--expert-budget": self.budget,
                 "--moce-exact-prefill": self.exact_prefill or None,
                 "--moce-natural-prefetch": self.natural_prefetch or None,
                 "--moce-count-inflight": self.count_inflight or None}
        if self.protect is None:
            given = [name for name, value in knobs.items() if value is not None]
            if given:
                raise ConfigError(f"{given[0]} needs --moce-protect J (cache-aware routing is off without it)")
            return
        for name, value in (("--moce-protect", self.protect), ("--draft-moce-protect", self.draft_protect),
                            ("--expert-budget", self.budget)):
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        for name, value in (("--moce-bonus", self.bonus), ("--draft-moce-bonus", self.draft_bonus)):
            if value is not None and not 0 <= value < float("inf"):  # also rejects NaN
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if self.budget is not None and min(self.protect, self.draft_j) < 1:
            raise ConfigError(
                f"--expert-budget needs --moce-protect and --draft-moce-protect >= 1 (every token keeps its "
                f"top expert), got {self.protect} and {self.draft_j}"
            )
        if self.budget is not None and self.exact_prefill:
            raise ConfigError(f"--expert-budget ({self.budget}) caps every window; --moce-exact-prefill would "
                              f"exceed it on prompt chunks: give one of them")

    @property
    def is_enabled(self) -> bool:
        return self.protect is not None

    @property
    def draft_j(self) -> int:
        return self.protect if self.draft_protect is None else self.draft_protect

    def knobs(self, *, is_draft: bool) -> tuple[int, float]:
        """(J, B) for a root row or a draft row."""
        base_b = self.bonus or 0.0
        if not is_draft:
            return self.protect, base_b
        return self.draft_j, base_b if self.draft_bonus is None else self.draft_bonus


DEMO_MODEL = "demo"  # the model argument that names the embedded checkpoint


DEFAULT_PIPELINE_TIMEOUT = 300.0  # seconds one window or prompt chunk may take across ranks


@dataclass(frozen=True)
class PipelineOptions:
    """How ranks started by `mlx.launch` share a model (distributed.py); ignored by one process.

    Args:
        split: layers per rank, in rank order (e.g. (20, 28)); None (default) = balanced by
            weight bytes (rank 0's share counts the embeddings and the output head it holds).
        timeout: seconds a rank waits for the others within one window or prompt chunk before
            it ends with one error line (default 300); waiting for the next request is unbounded.
    """

    split: tuple[int, ...] | None = None
    timeout: float = DEFAULT_PIPELINE_TIMEOUT

    def __post_init__(self):
        if self.split is not None and (not self.split or any(n < 1 for n in self.split)):
            raise ConfigError(f"pipeline split must give every rank at least one layer, got {list(self.split)}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"pipeline timeout must be a positive number of seconds, got {self.timeout}")


def parse_pipeline_split(value: str) -> tuple[int, ...]:
    """"20,28" -> (20, 28): layers per rank.

    Raises:
        ConfigError: not a comma-separated list of positive integers.
    """
    try:
        split = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ConfigError(f"pipeline split must be layers per rank separated by commas (e.g. 20,28), got {value!r}") from None
    PipelineOptions(split=split)
    return split


@dataclass(frozen=True)
class LoadOptions:
    """Which checkpoint to open and how (runtime.open_model).

    Args:
        model: a checkpoint directory, or "demo" (default) for the embedded model.
        dtype: "float32", "bfloat16", "float16", or None (default) for the checkpoint's own
            (float32 on CPU).
        stream: expert cache budget, prefetch and I/O of a streamed checkpoint (default
            `StreamOptions()`; only a streamed checkpoint takes non-default ones).
        moce: cache-aware (approximate) routing of a streamed checkpoint (default off).
        download: fetch a Hugging Face repo id given as `model` when the hub cache lacks it
            (default False: say what to run instead).
        pipeline: how ranks from `mlx.launch` split the layers (default `PipelineOptions()`).
    """

    model: str = DEMO_MODEL
    dtype: str | None = None
    stream: StreamOptions = field(default_factory=lambda: StreamOptions())
    moce: MoceOptions = field(default_factory=lambda: MoceOptions())
    download: bool = False
    pipeline: PipelineOptions = field(default_factory=lambda: PipelineOptions())

    def __post_init__(self):
        if not self.model:
            raise ConfigError("the model path is empty (pass a checkpoint directory, a Hugging Face repo id, or 'demo')")
        if self.dtype not in (None, *DTYPE_NAMES):
            raise ConfigError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")


@dataclass(frozen=True)
class GenerateOptions:
    """What one request asks for.

    Args:
        max_tokens: most tokens to generate (default 256).
        temperature: 0 is greedy (default); above 0 samples from the processed distribution
            softmax(processed logits / temperature), filtered by top_k, top_p and min_p. One
            below MIN_SAMPLING_TEMPERATURE (float32's smallest normal) is greedy too; one past
            float32's largest is sampled as float32's largest (sampling.py).
        seed: seeds this request's own sampler; the global seed is left alone. None (default) =
            a fresh seed from the system for each request (request.py reports the one used).
        top_k: sample among the k most likely tokens only (0 = off, the default). Sampling only.
        top_p: sample from the smallest set of most likely tokens whose probability reaches
            top_p (1.0 = off, the default); the most likely token(s) are always in it, so a
            top_p below float32's resolution keeps just them. Sampling only.
        min_p: drop tokens less likely than min_p times the most likely one (0 = off, the
            default). Sampling only.
        repetition_penalty: divide positive logits (multiply negative ones) of tokens among the
            last `repetition_context` tokens, prompt included, by this (1.0 = off, the default).
        repetition_context: how many recent tokens the repetition penalty looks at (default 20).
        presence_penalty: subtract this from the logit of every token generated so far (OpenAI
            semantics: generated tokens only; 0 = off, the default; -2..2).
        frequency_penalty: subtract this times a token's count among the generated tokens
            (OpenAI semantics; 0 = off, the default; -2..2).
        ban_phrases: phrases that never appear in the output as the token sequences the
            tokenizer gives them (processors.py); () = none (the default).
        heal: heal the prompt's edge (healing.py): back up over its trailing token(s) and make
            the first generated tokens reproduce their text (default True). The text edges that
            tokenize a prompt plan it (`generate`, serve-stdio's `prompt` requests); bench and
            `decode.generate` take token ids as they are.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = DEFAULT_REPETITION_CONTEXT
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ban_phrases: tuple[str, ...] = ()
    heal: bool = True

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails both
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")
        filters = [f"{name} {value}" for name, value, off in
                   (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0), ("min_p", self.min_p, 0.0)) if value != off]
        if self.temperature == 0 and filters:
            raise ConfigError(f"{' and '.join(filters)} only {'apply' if len(filters) > 1 else 'applies'} when "
                              "sampling: set temperature above 0 too")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repetition_context < 1:
            raise ConfigError(f"repetition_context must be at least 1, got {self.repetition_context}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not phrase.strip() for phrase in self.ban_phrases):
            raise ConfigError("a banned phrase is empty")

    @property
    def is_sampling(self) -> bool:
        """Whether tokens are drawn: temperature at least MIN_SAMPLING_TEMPERATURE, else greedy."""
        return self.temperature >= MIN_SAMPLING_TEMPERATURE

    @property
    def has_processors(self) -> bool:
        """Whether a logit processor with per-position state applies (processors.py)."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.ban_phrases
        )


def read_ban_phrases(path: str) -> tuple[str, ...]:
    """The phrases of a --ban-phrases file: one per line, blank lines skipped, each line kept
    as written (less its line break)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"ban phrases {path}: cannot read it ({e})") from None
    phrases = tuple(line for line in lines if line.strip())
    if not phrases:
        raise ConfigError(f"ban phrases {path}: no phrases (one per line)")
    return phrases


@dataclass(frozen=True)
class SpecOptions:
    """Suffix-lookup speculative decoding.

    Args:
        max_drafts: most drafts per window (0 = off, the default); with `auto`, the maximum the
            controller may choose.
        min_match: shortest suffix match (in tokens) that may propose drafts (default 4, at least 3).
        auto: let the draft-length controller (speculative/controller.py) choose each window's number
            of drafts, up to `max_drafts` (default False: use every draft the proposal offers).
        cost_prior: the controller's prior window cost by T (a measured curve); None (default)
            = its built-in linear prior. Only with `auto`.
    """

    max_drafts: int = 0
    min_match: int = DEFAULT_MIN_MATCH
    auto: bool = False
    cost_prior: CostPrior | None = None

    def __post_init__(self):
        if not 0 <= self.max_drafts <= MAX_SUFFIX_DRAFT:
            raise ConfigError(
                f"suffix draft must be in 0..{MAX_SUFFIX_DRAFT}, got {self.max_drafts}"
            )
        if self.min_match < 3:
            raise ConfigError(
                f"min_match must be at least 3 (drafts are looked up by trigram), got {self.min_match}"
            )
        if self.auto and self.max_drafts < 1:
            raise ConfigError(f"auto draft length needs a maximum of at least 1, got {self.max_drafts}")
        if self.cost_prior is not None and not self.auto:
            raise ConfigError("a draft cost curve only applies to --suffix-draft auto")

    @property
    def is_speculative(self) -> bool:
        return self.max_drafts > 0

    @property
    def label(self) -> str:
        """The --suffix-draft value this stands for: "0", "3", "auto:7"."""
        return f"auto:{self.max_drafts}" if self.auto else str(self.max_drafts)


def parse_suffix_draft(value: str | int) -> tuple[int, bool]:
    """Read a --suffix-draft value: N (0..7, fixed), "auto" (controller, at most 7 drafts) or
    "auto:N" (controller, at most N).

    Returns:
        (max_drafts, auto).

    Raises:
        ConfigError: anything else, naming the accepted forms.
    """
    text = str(value).strip().lower()
    forms = f"expected 0..{MAX_SUFFIX_DRAFT}, 'auto' or 'auto:N' with N in 1..{MAX_SUFFIX_DRAFT}"
    auto = text == "auto" or text.startswith("auto:")
    number = text[len("auto:"):] if text.startswith("auto:") else (str(MAX_SUFFIX_DRAFT) if auto else text)
    try:
        n = int(number)
    except ValueError:
        raise ConfigError(f"suffix draft {value!r}: {forms}") from None
    if not (1 if auto else 0) <= n <= MAX_SUFFIX_DRAFT:
        raise ConfigError(f"suffix draft {value!r}: {forms}")
    return n, auto


DEFAULT_PREFIX_CACHE_ENTRIES = 32
DEFAULT_PREFIX_CACHE_POSITIONS = 65536
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ServeOptions:
    """What `serve-stdio` keeps across requests.

    Args:
        session: file the committed state is restored from at start and saved to at exit (None = none).
        prefix_cache_entries: most committed-state checkpoints kept for prefix reuse (0 = no reuse).
        prefix_cache_positions: most positions all checkpoints together may hold (KV memory grows
            with it).
        checkpoint_every: also checkpoint the prompt prefill at every multiple of this many
            positions (0 = only at the prompt's end, the divergence point and the end of generation).
        suffix_cache_tokens: tokens of earlier requests' outputs kept for cross-request drafts
            (0 = off, the default).
        max_line_bytes: longest request line; longer lines are answered with an error unread.
    """

    session: str | None = None
    prefix_cache_entries: int = DEFAULT_PREFIX_CACHE_ENTRIES
    prefix_cache_positions: int = DEFAULT_PREFIX_CACHE_POSITIONS
    checkpoint_every: int = PREFILL_CHUNK
    suffix_cache_tokens: int = 0
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES

    def __post_init__(self):
        for name in ("prefix_cache_entries", "prefix_cache_positions", "checkpoint_every", "suffix_cache_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_line_bytes < 1024:
            raise ConfigError(f"max_line_bytes must be at least 1024, got {self.max_line_bytes}")
        if self.session is not None and self.prefix_cache_entries < 1:
            raise ConfigError("a session is restored through the prefix cache: prefix_cache_entries must be >= 1")


DEFAULT_HTTP_HOST = "127.0.0.1"  # loopback only unless asked: `strata serve` has no TLS
DEFAULT_HTTP_PORT = 8080
DEFAULT_MAX_QUEUE = 16
DEFAULT_HTTP_SUFFIX_CACHE = 65536  # agents resend what earlier answers said: on by default over HTTP


@dataclass(frozen=True)
class HttpOptions:
    """What `strata serve` (the OpenAI-compatible HTTP server) listens on and admits.

    Args:
        host: address to bind (default 127.0.0.1).
        port: TCP port (default 8080; 0 = any free port, logged at start).
        max_queue: requests that may wait behind the one running (default 16); one more gets 503.
        max_body_bytes: largest request body (default 4 MiB); a larger one gets 413.
        request_timeout: seconds a request may take from arrival, queue wait included (None,
            the default = no limit); then it stops at the next window and answers what it has.
        api_key: when set, every /v1 and /metrics request needs `Authorization: Bearer KEY`.
        model_name: the model's id in /v1/models and the `model` requests may name (None, the
            default: the --model value's, resolved by the CLI: serve/http.py `model_name`).
    """

    host: str = DEFAULT_HTTP_HOST
    port: int = DEFAULT_HTTP_PORT
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_LINE_BYTES
    request_timeout: float | None = None
    api_key: str | None = None
    model_name: str | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.request_timeout is not None and not (self.request_timeout > 0 and math.isfinite(self.request_timeout)):
            raise ConfigError(f"request_timeout must be a positive number of seconds, got {self.request_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("the model name is empty")
