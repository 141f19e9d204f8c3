"""The CLI's options: click parameter types, STRATA_* fallbacks that name their variable, and one
decorator per option group that turns a command's flags into one checked options object
(options.py). Each option is declared once, here, with the help panel it is listed in."""


from __future__ import annotations

import functools
import inspect
import math
import os
import re
from pathlib import Path

import rich_click as click
from click.core import ParameterSource

from .model.config import DTYPE_NAMES
from .options import (
    DEFAULT_EXPERT_IO_THREADS,
    DEFAULT_EXPERT_PREFETCH,
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFIX_CACHE_ENTRIES,
    DEFAULT_PREFIX_CACHE_POSITIONS,
    DEFAULT_MIN_MATCH,
    DEFAULT_REPETITION_CONTEXT,
    DEMO_MODEL,
    MAX_SUFFIX_DRAFT,
    EXPERT_IO_MODES,
    EXPERT_PREFETCH_MODES,
    COMPRESSED_ROLLBACK_MODES,
    FOLD_MODES,
    PREFILL_CHUNK,
    ConfigError,
    EngineOptions,
    GenerateOptions,
    HttpOptions,
    LoadOptions,
    MoceOptions,
    PipelineOptions,
    ServeOptions,
    SpecOptions,
    StreamOptions,
    DEFAULT_PIPELINE_TIMEOUT,
    parse_pipeline_split,
    parse_suffix_draft,
    read_ban_phrases,
)


# The panels `--help` lists options in, everyday ones first.
MODEL = "Model"
OUTPUT = "Output"
SAMPLING = "Sampling"
SPECULATIVE = "Speculative decoding"
ENGINE = "Engine"
STREAMING = "Expert streaming"
EXPERIMENTAL = "Experiments and approximate modes (off by default)"
SERVER = "Server"
PIPELINE = "Ranks (mlx.launch)"
BENCH = "Bench"
PANEL_ORDER = (MODEL, OUTPUT, SAMPLING, SPECULATIVE, SERVER, BENCH, ENGINE, STREAMING, PIPELINE, EXPERIMENTAL)


def panels(command):
    """List a command's option panels in PANEL_ORDER (empty ones are not shown)."""
    for name in reversed(PANEL_ORDER):
        command = click.option_panel(name)(command)
    return command


class EnvOption(click.RichOption):
    """A click option whose error names the STRATA_* variable when the bad value came from it."""

    def get_error_hint(self, ctx) -> str:
        hint = super().get_error_hint(ctx)
        source = ctx.get_parameter_source(self.name) if ctx is not None else None
        if source is ParameterSource.ENVIRONMENT and isinstance(self.envvar, str):
            hint += f" (from {self.envvar}={os.environ.get(self.envvar, '')!r})"
        return hint


def option(*names, **attrs):
    """`click.option` with `EnvOption`: every strata option (`panel=` names its help panel)."""
    return click.option(*names, cls=EnvOption, **attrs)


class SuffixDraftType(click.ParamType):
    """--suffix-draft: N (0..7), 'auto' or 'auto:N'; converts to (max_drafts, auto)."""

    name = "N|auto[:N]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_suffix_draft(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


SUFFIX_DRAFT = SuffixDraftType()


class PipelineSplitType(click.ParamType):
    """--pipeline-split: layers per rank, "20,28"; converts to a tuple of ints."""

    name = "N,N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_pipeline_split(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses inf and nan (click takes both as floats)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


def spec_options(suffix_draft: tuple[int, bool], min_match: int, draft_cost: str | None) -> SpecOptions:
    """SpecOptions from the --suffix-draft, --min-match and --draft-cost values.

    Raises:
        ConfigError: an option combination that does not apply, or an unusable cost curve.
    """
    from .speculative.controller import CostCurveError, CostPrior

    max_drafts, auto = suffix_draft
    try:
        cost_prior = CostPrior.from_json(draft_cost) if draft_cost else None
    except CostCurveError as e:
        raise ConfigError(f"--draft-cost: {e}") from None
    return SpecOptions(max_drafts=max_drafts, min_match=min_match, auto=auto, cost_prior=cost_prior)


def options_object(name: str, build, options: list):
    """A decorator adding click `options` to a command; their values go through `build(**values)`
    (a checked options object) and reach the command as one argument, `name`. A `ConfigError`
    from `build` is reported as a bad parameter."""
    params = list(inspect.signature(build).parameters)

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            values = {param: kwargs.pop(param) for param in params}
            try:
                kwargs[name] = build(**values)
            except ConfigError as e:
                raise click.BadParameter(str(e)) from None
            return command(*args, **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


# -- every option, declared once ------------------------------------------------------------------

MAX_TOKENS = option("--max-tokens", "-n", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS,
                    envvar="STRATA_MAX_TOKENS", show_default=True, panel=SAMPLING,
                    help="Most tokens to generate per prompt (serve-stdio: for requests that leave it out).")
TEMPERATURE = option("--temperature", "-t", type=FiniteFloatRange(min=0.0), default=0.0,
                     envvar="STRATA_TEMPERATURE", show_default=True, panel=SAMPLING,
                     help="0 is greedy; above 0 samples (below float32's smallest normal, 1.2e-38, is greedy too).")
SEED = option("--seed", type=click.IntRange(0, 2**63 - 1), default=None, envvar="STRATA_SEED", panel=SAMPLING,
              help="Seed for sampling: each prompt uses its own sampler, so the same seed gives the same "
                   "text with any --suffix-draft  [default: a fresh seed per prompt, reported as 'seed' in "
                   "--json and --stats]")


def suffix_draft_option(default: str):
    """--suffix-draft with a command's own default ("0" everywhere; `serve` drafts with "auto")."""
    return option(
        "--suffix-draft", type=SUFFIX_DRAFT, default=default, envvar="STRATA_SUFFIX_DRAFT", show_default=True,
        panel=SPECULATIVE,
        help="At most N suffix-lookup drafts per window (0 = off); 'auto' lets the draft-length controller "
             f"choose up to {MAX_SUFFIX_DRAFT} per window, 'auto:N' up to N. Greedy output is identical either way.")


SUFFIX_DRAFT_OPTION = suffix_draft_option("0")
DRAFT_COST = option(
    "--draft-cost", type=click.Path(exists=True, dir_okay=False), default=None, envvar="STRATA_DRAFT_COST",
    panel=SPECULATIVE,
    help="The auto controller's cost prior: a measured window-cost curve (scripts/bench/window_cost.py "
         "JSON, or a JSON list of seconds for T = 1, 2, ...); default: measured on this device once and cached.")
class LinesType(click.types.StringParamType):
    """A string option given several times; from its STRATA_* variable, one value per line."""

    envvar_list_splitter = "\n"


def stop_strings(ctx, param, values) -> tuple[str, ...]:
    if any(not value for value in values):
        raise click.BadParameter("a stop string must not be empty", ctx, param)
    return tuple(values)


STOP = option("--stop", type=LinesType(), multiple=True, envvar="STRATA_STOP", panel=OUTPUT, metavar="TEXT",
              callback=stop_strings,
              help="End the text before the first occurrence of TEXT (repeatable; finish_reason 'stop'). "
                   "STRATA_STOP: one stop string per line.")
MIN_MATCH = option("--min-match", type=click.IntRange(min=3), default=DEFAULT_MIN_MATCH, envvar="STRATA_MIN_MATCH",
                   show_default=True, panel=SPECULATIVE,
                   help="Shortest suffix match (tokens) that may propose drafts.")


def generate_options(command):
    """--max-tokens, --temperature, --seed, the sampling filters, penalties, phrase bans and
    healing, passed to `command` as one `options: GenerateOptions` argument."""
    options = [
        MAX_TOKENS, TEMPERATURE, SEED,
        option("--top-k", type=click.IntRange(min=0), default=0, envvar="STRATA_TOP_K", show_default=True,
               panel=SAMPLING, help="Sample among the K most likely tokens only (0 = off; needs --temperature > 0)."),
        option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, envvar="STRATA_TOP_P",
               show_default=True, panel=SAMPLING,
               help="Nucleus sampling: the smallest set of likeliest tokens with this much probability "
                    "(1 = off; needs --temperature > 0)."),
        option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=0.0, envvar="STRATA_MIN_P",
               show_default=True, panel=SAMPLING,
               help="Drop tokens less likely than MIN_P times the likeliest (0 = off; needs --temperature > 0)."),
        option("--repetition-penalty", type=click.FloatRange(0, min_open=True), default=1.0,
               envvar="STRATA_REPETITION_PENALTY", show_default=True, panel=SAMPLING,
               help="Penalise tokens among the last --repetition-context tokens, prompt included (1 = off)."),
        option("--repetition-context", type=click.IntRange(min=1), default=DEFAULT_REPETITION_CONTEXT,
               envvar="STRATA_REPETITION_CONTEXT", show_default=True, panel=SAMPLING,
               help="How many recent tokens the repetition penalty looks at."),
        option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, envvar="STRATA_PRESENCE_PENALTY",
               show_default=True, panel=SAMPLING,
               help="Subtract this from the logit of every token generated so far (OpenAI)."),
        option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, envvar="STRATA_FREQUENCY_PENALTY",
               show_default=True, panel=SAMPLING,
               help="Subtract this times each token's count among the generated tokens (OpenAI)."),
        option("--ban-phrases", type=click.Path(exists=True, dir_okay=False), default=None,
               envvar="STRATA_BAN_PHRASES", metavar="FILE", panel=SAMPLING,
               help="Phrases (one per line) the output never contains as tokens."),
        option("--no-heal", is_flag=True, envvar="STRATA_NO_HEAL", panel=SAMPLING,
               help="Take the prompt's tokens as they are: no backing up over a trailing space, newline or "
                    "partial word to let the first tokens rewrite it."),
    ]

    def build(max_tokens, temperature, seed, top_k, top_p, min_p, repetition_penalty, repetition_context,
              presence_penalty, frequency_penalty, ban_phrases, no_heal):
        try:
            return GenerateOptions(
                max_tokens=max_tokens, temperature=temperature, seed=seed, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, repetition_context=repetition_context,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                ban_phrases=read_ban_phrases(ban_phrases) if ban_phrases else (), heal=not no_heal,
            )
        except ConfigError as e:  # the options' field names, as the flags a CLI user typed
            raise ConfigError(FIELD_NAME.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None

    return options_object("options", build, options)(command)


FIELD_NAME = re.compile(r"\b(top_k|top_p|min_p|temperature|max_tokens|repetition_penalty|repetition_context|"
                        r"presence_penalty|frequency_penalty)\b")


def speculative_options(command=None, *, draft_default: str = "0"):
    """--suffix-draft, --draft-cost and --min-match, passed to `command` as one `spec: SpecOptions`
    argument. `@speculative_options` drafts nothing by default; `@speculative_options(draft_default="auto")`
    lets the controller draft unless told otherwise."""
    def build(suffix_draft, draft_cost, min_match):
        return spec_options(suffix_draft, min_match, draft_cost)

    draft = SUFFIX_DRAFT_OPTION if draft_default == "0" else suffix_draft_option(draft_default)
    decorate = options_object("spec", build, [draft, DRAFT_COST, MIN_MATCH])
    return decorate if command is None else decorate(command)


def draft_options(command):
    """--draft-cost and --min-match without --suffix-draft (bench names its draft modes), passed to
    `command` as one `drafts: dict` argument (min_match, cost_prior)."""
    def build(draft_cost, min_match):
        return {"min_match": min_match,
                "cost_prior": spec_options((MAX_SUFFIX_DRAFT, True), min_match, draft_cost).cost_prior}

    return options_object("drafts", build, [DRAFT_COST, MIN_MATCH])(command)


def model_options(command):
    """--model, --dtype and the expert-streaming options of every command that opens a model,
    passed to `command` as one `load: LoadOptions` argument."""
    options = [
        option("--model", "-m", default=DEMO_MODEL, envvar="STRATA_MODEL", show_default=True, panel=MODEL,
               help="Checkpoint directory (config.json, *.safetensors, tokenizer.json), a Hugging Face "
                    "repo id in the local hub cache (e.g. mlx-community/Qwen3-30B-A3B-4bit), or 'demo', "
                    "the embedded model."),
        option("--download", is_flag=True, envvar="STRATA_DOWNLOAD", panel=MODEL,
               help="Download a --model repo id the Hugging Face cache does not hold (the files strata "
                    "loads only)."),
        option("--dtype", type=click.Choice(DTYPE_NAMES), default=None, envvar="STRATA_DTYPE", panel=MODEL,
               help="Compute dtype (default: the checkpoint's; float32 on CPU)."),
        option("--expert-cache", type=FiniteFloatRange(min=0, min_open=True), default=None,
               envvar="STRATA_EXPERT_CACHE", metavar="GB", panel=STREAMING,
               help="Streamed checkpoints: expert cache budget in GB over all MoE layers "
                    "(default: every expert resident once read)."),
        option("--resident-experts", type=click.IntRange(min=1), default=None, envvar="STRATA_RESIDENT_EXPERTS",
               metavar="N", panel=STREAMING,
               help="Streamed checkpoints: resident experts per MoE layer (instead of --expert-cache)."),
        option("--expert-prefetch", type=click.Choice(EXPERT_PREFETCH_MODES), default=DEFAULT_EXPERT_PREFETCH,
               envvar="STRATA_EXPERT_PREFETCH", show_default=True, panel=STREAMING,
               help="Read ahead the next layer's experts predicted by its router on this layer's input "
                    "(router), by which experts followed before (history), or not at all (off)."),
        option("--expert-io", type=click.Choice(EXPERT_IO_MODES), default="auto", envvar="STRATA_EXPERT_IO",
               show_default=True, panel=STREAMING,
               help="Expert reads: O_DIRECT where allowed (auto), O_DIRECT only, or the page cache."),
        option("--expert-io-threads", type=click.IntRange(min=1), default=DEFAULT_EXPERT_IO_THREADS,
               envvar="STRATA_EXPERT_IO_THREADS", show_default=True, panel=STREAMING,
               help="Threads reading expert records."),
        option("--spec-root-prefetch/--no-spec-root-prefetch", default=False, envvar="STRATA_SPEC_ROOT_PREFETCH",
               show_default=True, panel=EXPERIMENTAL,
               help="Experiment: only row 0 of a window drives prefetch (demand reads serve every row)."),
        option("--expert-readahead-depth", type=click.IntRange(min=1), default=None,
               envvar="STRATA_EXPERT_READAHEAD_DEPTH", metavar="N", panel=EXPERIMENTAL,
               help="Experiment: demand reads first: at most N read-aheads at the disk at once and none while "
                    "a demand read waits; queued ones a layer did not pick are cancelled (default: no queue, "
                    "every read as it comes)."),
        option("--expert-readahead-min-prob", type=FiniteFloatRange(min=0, max=1, max_open=True), default=0.0,
               envvar="STRATA_EXPERT_READAHEAD_MIN_PROB", metavar="P", show_default=True, panel=EXPERIMENTAL,
               help="Experiment: router prefetch reads an expert only when its predicted router probability "
                    "is at least P (0: every predicted pick)."),
        option("--moce-protect", type=int, default=None, envvar="STRATA_MOCE_PROTECT", metavar="J",
               panel=EXPERIMENTAL,
               help="Streamed checkpoints, APPROXIMATE: cache-aware routing; each token keeps its top J "
                    "experts and fills the rest preferring resident ones (default: off, exact routing)."),
        option("--moce-bonus", type=float, default=None, envvar="STRATA_MOCE_BONUS", metavar="B", panel=EXPERIMENTAL,
               help="With --moce-protect: resident experts' router probabilities are multiplied by exp(B) (default 0)."),
        option("--draft-moce-protect", type=int, default=None, envvar="STRATA_DRAFT_MOCE_PROTECT", metavar="J",
               panel=EXPERIMENTAL, help="With --moce-protect: J for draft rows 1..T-1 of a window (default: --moce-protect)."),
        option("--draft-moce-bonus", type=float, default=None, envvar="STRATA_DRAFT_MOCE_BONUS", metavar="B",
               panel=EXPERIMENTAL, help="With --moce-protect: B for draft rows (default: --moce-bonus)."),
        option("--expert-budget", type=int, default=None, envvar="STRATA_EXPERT_BUDGET", metavar="N",
               panel=EXPERIMENTAL,
               help="With --moce-protect: at most N non-resident experts loaded per layer per window beyond "
                    "the protected ones, then residents only (default: no budget)."),
        option("--moce-exact-prefill/--no-moce-exact-prefill", default=False, envvar="STRATA_MOCE_EXACT_PREFILL",
               show_default=True, panel=EXPERIMENTAL,
               help="With --moce-protect: prompt chunks route exactly; only decode windows use the MoCE knobs "
                    "(not with --expert-budget)."),
        option("--moce-natural-prefetch/--no-moce-natural-prefetch", default=False,
               envvar="STRATA_MOCE_NATURAL_PREFETCH", show_default=True, panel=EXPERIMENTAL,
               help="With --moce-protect: router prefetch reads the next layer's natural top-k, as exact "
                    "routing does, instead of predicting MoCE's own picks."),
        option("--moce-count-inflight/--no-moce-count-inflight", default=False,
               envvar="STRATA_MOCE_COUNT_INFLIGHT", show_default=True, panel=EXPERIMENTAL,
               help="With --moce-protect: experts whose read-ahead is already in flight for a layer get "
                    "the resident bonus there (their read is already paid for)."),
        option("--pipeline-split", type=PipelineSplitType(), default=None, envvar="STRATA_PIPELINE_SPLIT",
               metavar="N,N,...", panel=PIPELINE,
               help="Under mlx.launch: decoder layers per rank, in rank order (default: balanced by weight "
                    "bytes). One process ignores it."),
        option("--pipeline-timeout", type=FiniteFloatRange(min=0, min_open=True), default=DEFAULT_PIPELINE_TIMEOUT,
               envvar="STRATA_PIPELINE_TIMEOUT", metavar="SECONDS", show_default=True, panel=PIPELINE,
               help="Under mlx.launch: how long a rank waits for the others within one window or prompt "
                    "chunk before every rank ends with an error."),
    ]

    def build(model, download, dtype, expert_cache, resident_experts, expert_prefetch, expert_io, expert_io_threads,
              spec_root_prefetch, expert_readahead_depth, expert_readahead_min_prob, moce_protect, moce_bonus,
              draft_moce_protect, draft_moce_bonus, expert_budget, moce_exact_prefill, moce_natural_prefetch,
              moce_count_inflight, pipeline_split, pipeline_timeout):
        stream = StreamOptions(
            cache_gb=expert_cache, resident_experts=resident_experts, prefetch=expert_prefetch,
            root_prefetch=spec_root_prefetch, io=expert_io, io_threads=expert_io_threads,
            readahead_depth=expert_readahead_depth, readahead_min_prob=expert_readahead_min_prob,
        )
        moce = MoceOptions(protect=moce_protect, bonus=moce_bonus, draft_protect=draft_moce_protect,
                           draft_bonus=draft_moce_bonus, budget=expert_budget, exact_prefill=moce_exact_prefill,
                           natural_prefetch=moce_natural_prefetch, count_inflight=moce_count_inflight)
        pipeline = PipelineOptions(split=pipeline_split, timeout=pipeline_timeout)
        return LoadOptions(model=model, dtype=dtype, stream=stream, moce=moce, download=download, pipeline=pipeline)

    return options_object("load", build, options)(command)


def engine_options(command):
    """The window engine's options (context, fold, partial mode, shape warm-up), passed to
    `command` as one `engine: EngineOptions` argument."""
    options = [
        option("--max-context", type=click.IntRange(min=2), default=None, envvar="STRATA_MAX_CONTEXT", panel=ENGINE,
               help="Positions the engine may hold (prompt + output); default: the model's maximum."),
        option("--warm-shapes/--no-warm-shapes", default=None, envvar="STRATA_WARM_SHAPES", panel=ENGINE,
               help="Run every window shape once at load (--warm-shapes), or never warm one, so a new "
                    "shape is built inside the window that first runs it (--no-warm-shapes)  [default: "
                    "GPU backends warm each shape just before its first window, outside its timing; "
                    "the CPU builds nothing per shape]"),
        option("--pad-windows/--no-pad-windows", default=None, envvar="STRATA_PAD_WINDOWS", panel=EXPERIMENTAL,
               help="Run each window as 1, 2, 4 or 8 rows, the extra rows never kept, so four shapes "
                    "serve every window (exact: a row computes what it computes alone)  [default: on "
                    "for GPU backends with resident experts, off on the CPU]"),
        option("--fold", type=click.Choice(FOLD_MODES), default="lazy", envvar="STRATA_FOLD", show_default=True,
               panel=EXPERIMENTAL,
               help="When kept GDN rows fold into the recurrent state: at the next window (lazy) "
                    "or at commit (eager). Both are exact."),
        option("--partial/--no-partial", default=False, envvar="STRATA_PARTIAL", show_default=True,
               panel=EXPERIMENTAL, help="Experiment: commit each window's root row inside the run (exact)."),
        option("--compressed-rollback", type=click.Choice(COMPRESSED_ROLLBACK_MODES), default="replay",
               envvar="STRATA_COMPRESSED_ROLLBACK", show_default=True, panel=EXPERIMENTAL,
               help="How compressed-attention tails (DeepSeek-V4) roll back: replay the kept rows "
                    "(any window size) or keep rings and cap windows at the compressor block. Both are exact."),
    ]

    def build(max_context, warm_shapes, pad_windows, fold, partial, compressed_rollback):
        return EngineOptions(fold=fold, partial=partial, max_context=max_context, warm_shapes=warm_shapes,
                             pad_windows=pad_windows, compressed_rollback=compressed_rollback)

    return options_object("engine", build, options)(command)


# --session, for serve-stdio and `strata serve` alike (serve/server.py `restore_session`, `save_session_of`).
session_option = option(
    "--session", type=click.Path(dir_okay=False, path_type=Path), default=None, envvar="STRATA_SESSION",
    panel=SERVER, help="Restore committed state from FILE at start (if it exists) and save it there at exit.")


def cache_options(command=None, *, suffix_cache: int = 0):
    """What a server keeps across requests (--prefix-cache, --prefix-cache-positions,
    --checkpoint-every, --suffix-cache with the command's own default), passed to `command` as
    one `serve: ServeOptions` argument. (serve-stdio still declares these four in cli.py, with
    --max-line-bytes; `strata serve` takes them from here. Both take --session from
    `session_option`.)"""
    options = [
        option("--prefix-cache", type=click.IntRange(min=0), default=DEFAULT_PREFIX_CACHE_ENTRIES,
               envvar="STRATA_PREFIX_CACHE", show_default=True, panel=SERVER,
               help="Most committed-state checkpoints kept for prefix reuse (0 = no reuse)."),
        option("--prefix-cache-positions", type=click.IntRange(min=1), default=DEFAULT_PREFIX_CACHE_POSITIONS,
               envvar="STRATA_PREFIX_CACHE_POSITIONS", show_default=True, panel=SERVER,
               help="Most positions all checkpoints together hold (their KV memory grows with it)."),
        option("--checkpoint-every", type=click.IntRange(min=0), default=PREFILL_CHUNK,
               envvar="STRATA_CHECKPOINT_EVERY", show_default=True, panel=SERVER,
               help="Also checkpoint a prompt's prefill at every multiple of N positions (0 = only at its end)."),
        option("--suffix-cache", type=click.IntRange(min=0), default=suffix_cache, envvar="STRATA_SUFFIX_CACHE",
               show_default=True, panel=SERVER, help="Tokens of earlier requests' outputs kept for drafts (0 = off)."),
    ]

    def build(prefix_cache, prefix_cache_positions, checkpoint_every, suffix_cache):
        return ServeOptions(prefix_cache_entries=prefix_cache, prefix_cache_positions=prefix_cache_positions,
                            checkpoint_every=checkpoint_every, suffix_cache_tokens=suffix_cache)

    decorate = options_object("serve", build, options)
    return decorate if command is None else decorate(command)


def http_options(command):
    """`strata serve`'s address, admission limits, API key and model name, passed to `command` as
    one `http: HttpOptions` argument."""
    options = [
        option("--host", default=DEFAULT_HTTP_HOST, envvar="STRATA_HOST", show_default=True, panel=SERVER,
               help="Address to listen on (0.0.0.0 exposes the server to the network: set --api-key)."),
        option("--port", type=click.IntRange(0, 65535), default=DEFAULT_HTTP_PORT, envvar="STRATA_PORT",
               show_default=True, panel=SERVER, help="TCP port (0 = any free port; the log line names it)."),
        option("--api-key", default=None, envvar="STRATA_API_KEY", panel=SERVER,
               help="Require 'Authorization: Bearer KEY' on /v1 and /metrics (default: no key)."),
        option("--model-name", default=None, envvar="STRATA_MODEL_NAME", panel=SERVER,
               help="The model's id in /v1/models, which requests' 'model' must match "
                    "(default: --model as given, or a directory's own name)."),
        option("--max-queue", type=click.IntRange(min=0), default=DEFAULT_MAX_QUEUE, envvar="STRATA_MAX_QUEUE",
               show_default=True, panel=SERVER,
               help="Requests that may wait behind the one running; one more is answered 503 with Retry-After."),
        option("--max-body-bytes", type=click.IntRange(min=1024), default=DEFAULT_MAX_LINE_BYTES,
               envvar="STRATA_MAX_BODY_BYTES", show_default=True, panel=SERVER,
               help="Larger request bodies are answered 413."),
        option("--request-timeout", type=FiniteFloatRange(min=0, min_open=True), default=None,
               envvar="STRATA_REQUEST_TIMEOUT", metavar="SECONDS", panel=SERVER,
               help="Stop a request this long after it arrived, queue wait included, and answer what it "
                    "generated (default: no limit)."),
    ]

    def build(host, port, api_key, model_name, max_queue, max_body_bytes, request_timeout):
        return HttpOptions(host=host, port=port, api_key=api_key, model_name=model_name, max_queue=max_queue,
                           max_body_bytes=max_body_bytes, request_timeout=request_timeout)

    return options_object("http", build, options)(command)
