"""The `strata` command: parse options, call the library, render. Nothing else lives here."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import click.core as click_core
import rich_click as click

from . import __version__, safe_files
from .cli_options import (
    BENCH,
    OUTPUT,
    SERVER,
    STOP,
    SEED,
    TEMPERATURE,
    cache_options,
    draft_options,
    engine_options,
    generate_options,
    http_options,
    model_options,
    option,
    panels,
    session_option,
    speculative_options,
)
from .model.config import DTYPE_NAMES
from .options import (
    CONVERT_BITS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_HTTP_SUFFIX_CACHE,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_PREFIX_CACHE_ENTRIES,
    DEFAULT_PREFIX_CACHE_POSITIONS,
    DEFAULT_SEED,
    PREFILL_CHUNK,
    QUANT_GROUP_SIZES,
    ConfigError,
    ConvertOptions,
    ServeOptions,
)
from .terminal import InterruptLatch, PrefillBar, Terminated, WarmUpBar, interrupt_latch, make_console


ANSWER_SEPARATOR = "---"  # the default line between plain-text answers of several prompts (--each-line)


class UserError(click.ClickException):
    """One clear line on stderr and exit status 1."""


def raise_errors() -> bool:
    """STRATA_RAISE_ERRORS=1 lets exceptions through with their traceback (for debugging)."""
    return os.environ.get("STRATA_RAISE_ERRORS", "") not in ("", "0")


def read_prompts(prompt: str | None, each_line: bool) -> list[str]:
    """The prompt argument, or stdin when piped or PROMPT is '-'; --each-line splits stdin."""
    use_stdin = prompt in (None, "-")
    if each_line and not use_stdin:
        raise UserError("--each-line reads prompts from stdin; drop the PROMPT argument or pass '-'")
    if use_stdin:
        if sys.stdin.isatty():
            if prompt is None:
                raise UserError("no prompt: pass PROMPT or pipe text on stdin")
            click.echo("reading the prompt from stdin until Ctrl-D (end of input)", err=True)
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"stdin is not valid UTF-8 (byte {e.start})") from None
    else:
        text = prompt
    if each_line:
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UserError("--each-line: stdin has no non-empty line")
        return prompts
    if not text:
        raise UserError("the prompt is empty")
    return [text]


class StrataGroup(click.RichGroup):
    """rich-click's help panels, with plain error output: "Error: ..." on one line of stderr
    (a usage error after a plain usage line and the --help hint), never a drawn box, so scripts
    and logs read it as they read click's."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        run = functools.partial(click_core.Group.main, self, args, prog_name, complete_var, **extra)
        if not standalone_mode:
            return run(standalone_mode=False)
        try:
            result = run(standalone_mode=False)
        except click.exceptions.NoArgsIsHelpError as e:  # plain `strata`: the help, exit 0 as click does
            click_core.echo(e.ctx.get_help())
            sys.exit(e.exit_code)
        except click.exceptions.UsageError as e:
            if e.ctx is not None:
                pieces = " ".join(e.ctx.command.collect_usage_pieces(e.ctx))
                click_core.echo(f"Usage: {e.ctx.command_path} {pieces}\n"
                                f"Try '{e.ctx.command_path} --help' for help.\n", err=True)
            click_core.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click_core.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=StrataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="strata")
def cli():
    """strata: sparse Mixture-of-Experts models on MLX, with lossless suffix-lookup
    speculative decoding.

    Every option can also be set with a STRATA_* environment variable
    (for example STRATA_MODEL, STRATA_SUFFIX_DRAFT).
    """


@cli.command()
@click.argument("prompt", required=False)
@panels
@generate_options
@speculative_options
@STOP
@option("--stats", is_flag=True, envvar="STRATA_STATS", panel=OUTPUT, help="Print decode telemetry to stderr.")
@option("--json", "as_json", is_flag=True, envvar="STRATA_JSON", panel=OUTPUT,
        help="Print one JSON object per prompt (index, prompt, text, token_ids, finish_reason, stats) instead of streaming text.")
@option("--each-line", is_flag=True, envvar="STRATA_EACH_LINE", panel=OUTPUT,
        help="Treat every non-empty stdin line as its own prompt (plain answers are separated by --separator).")
@option("--separator", default=ANSWER_SEPARATOR, envvar="STRATA_SEPARATOR", show_default=True, panel=OUTPUT,
        help="With --each-line: the line printed between plain-text answers (generated code may contain "
             "'---'; pick a line it cannot, or use --json).")
@model_options
@engine_options
def generate(prompt, options, spec, stop, stats, as_json, each_line, separator, load, engine):
    """Generate text from PROMPT (or from stdin when piped, or when PROMPT is '-').

    \b
    Examples:
      strata generate "def fibonacci(n):"
      cat edit_request.txt | strata generate --suffix-draft 3 --max-tokens 200
      strata generate --each-line --json < prompts.txt
      strata generate -t 0.7 --top-p 0.9 --suffix-draft auto --repetition-penalty 1.1 "def f(x):"
    """
    if separator != ANSWER_SEPARATOR and not each_line:
        raise click.UsageError("--separator applies only with --each-line")
    if "\n" in separator:
        raise click.BadParameter("the separator is one line", param_hint="'--separator'")
    from .distributed import launched_ranks

    if prompt in (None, "-") and launched_ranks() > 1:
        raise UserError("under mlx.launch pass the prompt as an argument: the launcher never ends the ranks' stdin")
    prompts = read_prompts(prompt, each_line)
    run_guarded(lambda: _generate(load, engine, prompts, options, spec, stop, stats, as_json, separator))


def _generate(load, engine_options, prompts, gen_options, spec, stop, show_stats, as_json, separator):
    from .request import FINISH_CANCELLED, TextRequest
    from .telemetry import DecodeStats

    console = make_console(stderr=True)
    warming = WarmUpBar(console)
    try:
        runtime = open_runtime(load, engine_options, announce=warming.announce, warm_progress=warming)
    finally:
        warming.close()
    spec = runtime.spec_for(spec)  # auto without --draft-cost: the device's own cost curve
    if show_stats:
        for note in ([] if runtime.verification.is_verified else [runtime.verification.note]) + runtime.load_notes:
            click.echo(f"note: {note}", err=True)
    out = sys.stdout
    with interrupt_latch() as latch:
        for n, prompt in enumerate(prompts):
            stats = DecodeStats(warmup_seconds=runtime.warmup_seconds,
                                calibration_seconds=runtime.calibration_seconds)
            request = TextRequest(runtime.tokenizer, prompt, gen_options, stop=stop, stats=stats)
            bar = PrefillBar(console)
            try:
                latch.check()
                for delta in request.stream(runtime.engine, spec=spec, prefill_progress=bar):
                    if not as_json:
                        out.write(delta)
                        out.flush()
                latch.armed = False  # inside the try: a signal a moment earlier still lands in except
            except InterruptLatch.Cancelled:  # keep what was generated, then exit 130/143
                pass
            finally:
                latch.armed = False  # another error's way out
                bar.close()  # an interrupted prefill must not leave the bar drawn
            tail = request.close()
            stopped = request.finish_reason == FINISH_CANCELLED
            for message in stats.notes:
                click.echo(f"note: {message}", err=True)
            if as_json:
                record = {
                    "index": n,
                    "prompt": prompt,
                    "text": request.text,
                    "token_ids": request.token_ids,
                    "finish_reason": request.finish_reason,
                    "weights": "verified" if runtime.verification.is_verified else "unverified",
                    "stats": stats.summary(),
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                out.write(tail + "\n")
                if n + 1 < len(prompts) and not stopped:
                    out.write(separator + "\n")
            out.flush()
            if show_stats:
                stats.render(console, title=f"strata decode, prompt {n + 1}/{len(prompts)}")
            if stopped:
                raise latch.exit_exception()
        if latch.signum is not None:  # it came after the last prompt: everything is written
            raise latch.exit_exception()


@cli.command("serve-stdio")
@panels
@generate_options
@speculative_options
@session_option
@option("--prefix-cache", type=click.IntRange(min=0), default=DEFAULT_PREFIX_CACHE_ENTRIES,
        envvar="STRATA_PREFIX_CACHE", show_default=True, panel=SERVER,
        help="Most committed-state checkpoints kept for prefix reuse (0 = no reuse).")
@option("--prefix-cache-positions", type=click.IntRange(min=1), default=DEFAULT_PREFIX_CACHE_POSITIONS,
        envvar="STRATA_PREFIX_CACHE_POSITIONS", show_default=True, panel=SERVER,
        help="Most positions all checkpoints together hold (their KV memory grows with it).")
@option("--checkpoint-every", type=click.IntRange(min=0), default=PREFILL_CHUNK,
        envvar="STRATA_CHECKPOINT_EVERY", show_default=True, panel=SERVER,
        help="Also checkpoint a prompt's prefill at every multiple of N positions (0 = only at its end).")
@option("--suffix-cache", type=click.IntRange(min=0), default=0, envvar="STRATA_SUFFIX_CACHE",
        show_default=True, panel=SERVER, help="Tokens of earlier requests' outputs kept for drafts (0 = off).")
@option("--max-line-bytes", type=click.IntRange(min=1024), default=DEFAULT_MAX_LINE_BYTES,
        envvar="STRATA_MAX_LINE_BYTES", show_default=True, panel=SERVER,
        help="Longer request lines get an error reply.")
@option("--verbose", "-v", is_flag=True, envvar="STRATA_VERBOSE", panel=SERVER, help="Log every request on stderr.")
@model_options
@engine_options
def serve_stdio_command(options, spec, session, prefix_cache, prefix_cache_positions, checkpoint_every,
                        suffix_cache, max_line_bytes, verbose, load, engine):
    """Answer JSON-lines requests from stdin with JSON-lines frames on stdout.

    stdout carries protocol frames only, a ready frame first; logs go to stderr. A line
    {"cancel": ID} stops request ID. Exit status: 0 at end of input, 130 after SIGINT, 143 after
    SIGTERM, 1 when the model or the session file cannot be used. The protocol is in
    docs/serve.md.

    \b
    Examples:
      echo '{"id": 1, "prompt": "def f(x):", "max_tokens": 16}' | strata serve-stdio
      strata serve-stdio --session chat.session --suffix-cache 65536 < requests.jsonl
    """
    import logging

    from .serve.server import serve_stdio

    try:
        serve_options = ServeOptions(
            session=None if session is None else str(session), prefix_cache_entries=prefix_cache,
            prefix_cache_positions=prefix_cache_positions, checkpoint_every=checkpoint_every,
            suffix_cache_tokens=suffix_cache, max_line_bytes=max_line_bytes,
        )
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if verbose else logging.INFO,
                        format="strata serve: %(message)s")
    def serve():
        runtime = open_runtime(load, engine, announce=lambda line: click.echo(line, err=True))
        return serve_stdio(runtime, serve_options=serve_options, defaults=options, spec=runtime.spec_for(spec))

    run_guarded(lambda: sys.exit(serve()))


@cli.command("serve")
@panels
@generate_options
@speculative_options(draft_default="auto")
@http_options
@session_option
@cache_options(suffix_cache=DEFAULT_HTTP_SUFFIX_CACHE)
@option("--verbose", "-v", is_flag=True, envvar="STRATA_VERBOSE", panel=SERVER,
        help="Log every HTTP request and every completion on stderr.")
@model_options
@engine_options
def serve_command(options, spec, http, session, serve, verbose, load, engine):
    """Serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) on one model, requests queued first in, first out.

    Needs the 'serve' extra. SIGINT or SIGTERM stops accepting, answers every request already
    in (a second SIGINT drops them), saves the --session file and exits 0; 1 when the model or
    the session file cannot be used. Endpoints, fields and errors: docs/http.md.

    \b
    Examples:
      strata serve
      strata serve --model mlx-community/Qwen3-30B-A3B-4bit --port 8000 --api-key "$KEY"
      strata serve --session agent.session
      curl -s localhost:8080/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 16}'
    """
    import logging

    try:
        from .serve.http import model_name, serve_http
    except ImportError as e:  # the 'serve' extra is not installed
        missing = (e.name or "").partition(".")[0]
        if missing not in ("starlette", "uvicorn", "prometheus_client"):
            raise
        raise UserError(f"strata serve needs the 'serve' extra ({missing} is missing): "
                        "pip install 'strata-cli[serve]'") from None

    if http.model_name is None:
        http = replace(http, model_name=model_name(load.model))
    if session is not None:
        serve = replace(serve, session=str(session))
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if verbose else logging.INFO,
                        format="strata serve: %(message)s")

    def serve_forever():
        runtime = open_runtime(load, engine, announce=lambda line: click.echo(line, err=True))
        return serve_http(runtime, http=http, serve_options=serve, defaults=options, spec=runtime.spec_for(spec),
                          verbose=verbose)

    run_guarded(lambda: sys.exit(serve_forever()))


@cli.command("convert")
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@option("--bits", type=click.Choice([str(b) for b in CONVERT_BITS]), default=None, envvar="STRATA_BITS",
        help="Quantize the weights (affine, MLX layout) to this many bits; default: no quantization.")
@option("--group-size", type=click.Choice([str(g) for g in QUANT_GROUP_SIZES]), default=None,
        envvar="STRATA_GROUP_SIZE", help=f"Weights per quantization scale, with --bits  [default: {DEFAULT_GROUP_SIZE}]")
@option("--dtype", type=click.Choice(DTYPE_NAMES), default=None, envvar="STRATA_DTYPE",
        help="Dtype of the stored floating-point tensors (default: the checkpoint's).")
@option("--force", is_flag=True, envvar="STRATA_FORCE", help="Replace DST if it exists.")
@option("--stream", is_flag=True, envvar="STRATA_STREAM",
        help="Write the routed experts in the streaming layout (experts/: one aligned record per expert, "
             "read from disk through a bounded cache at run time).")
def convert_command(src, dst, bits, group_size, dtype, force, stream):
    """Convert the checkpoint in SRC (Hugging Face or MLX layout, or 'demo' for the embedded
    model) into strata's format in DST.

    DST gets config.json, safetensors shards of the ready-to-load parameters and the tokenizer
    files. It is written into a hidden sibling directory and renamed into place when complete.

    \b
    Examples:
      strata convert ~/models/Qwen3-30B-A3B ~/models/qwen3-30b-strata
      strata convert ~/models/Mixtral-8x7B ~/models/mixtral-q4 --bits 4
      strata convert ckpt out --bits 8 --group-size 32 --dtype bfloat16 --force
      strata convert ~/models/Qwen3-Next-80B-A3B ~/models/qwen3-next-q4-stream --bits 4 --stream
      strata convert demo demo-stream --stream
    """
    if group_size is not None and bits is None:
        raise click.UsageError("--group-size applies only with --bits")
    try:
        options = ConvertOptions(
            bits=None if bits is None else int(bits),
            group_size=DEFAULT_GROUP_SIZE if group_size is None else int(group_size),
            dtype=dtype,
            force=force,
            stream=stream,
        )
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    run_guarded(lambda: _convert(src, dst, options))


def _convert(src: str, dst: Path, options: ConvertOptions) -> None:
    from .convert import convert
    from .runtime import resolve_model_path

    # A bar on a terminal only; in a log, the "wrote ..." line below is the one line convert prints.
    result = convert(resolve_model_path(src), dst, options=options, show_progress=sys.stderr.isatty())
    quant = result.quantization
    detail = f", {quant['bits']}-bit, group size {quant['group_size']}" if quant else ""
    if options.stream:
        streamed = sum(f.stat().st_size for f in (result.path / "experts").glob("*.bin"))
        detail += f"; routed experts streamed: {streamed / 1e6:.1f} MB in experts/"
    click.echo(
        f"wrote {result.path} ({result.num_tensors} tensors in {result.num_shards} shard(s), "
        f"{result.total_bytes / 1e6:.1f} MB, {result.dtype}{detail})"
    )


@cli.command("verify")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, envvar="STRATA_JSON", help="Print one JSON object instead of lines.")
@click.option("--write-checksums", is_flag=True,
              help="For a checkpoint with nothing to check against (no checksums.json, not a hub cache): "
                   "record the digests just computed in MODEL/checksums.json, which every later load and "
                   "verify checks.")
def verify_command(model, as_json, write_checksums):
    """Hash every weight file of MODEL (a checkpoint directory, a cached repo id, or 'demo') and
    check it against its checksums.json or its Hugging Face hub-cache blob names; remembered
    digests are ignored. A streamed checkpoint's experts/index.json and every expert record's
    crc32 are checked too. Exits non-zero, naming the file, when one differs.

    \b
    Examples:
      strata verify ~/models/qwen3-next-q4-stream
      strata verify demo --json
      strata verify ~/models/my-download --write-checksums
    """
    run_guarded(lambda: _verify(model, as_json, write_checksums))


def _verify(model: str, as_json: bool, write_checksums: bool) -> None:
    from .experts.store import INDEX_NAME, STREAM_DIR
    from .integrity import CHECKSUMS_NAME
    from .integrity import write_checksums as record_checksums
    from .runtime import resolve_model_path
    from .verify import verify_checkpoint

    path = resolve_model_path(model)
    verification = verify_checkpoint(path)
    written = None
    if write_checksums:
        if verification.is_verified:
            raise UserError(f"{path}: already verified against {verification.source}; nothing to write")
        index = f"{STREAM_DIR}/{INDEX_NAME}"
        names = sorted(verification.digests) + ([index] if (path / index).is_file() else [])
        record_checksums(path, names)
        written = path / CHECKSUMS_NAME
    status = "verified" if verification.is_verified else "unverified"
    if as_json:
        click.echo(json.dumps({"path": str(path), "status": status, "against": verification.source or None,
                               "sha256": verification.digests, "expert_records": verification.expert_records,
                               "wrote": None if written is None else str(written)}))
        return
    for name, digest in sorted(verification.digests.items()):
        click.echo(f"{digest}  {name}")
    click.echo(f"{path}: {verification.note}")
    if written is not None:
        click.echo(f"wrote {written}: later loads and verify check these digests")
    elif not verification.is_verified:
        click_core.echo(f"note: nothing to check these digests against; 'strata verify {model} --write-checksums' "
                        "records them in checksums.json (strata convert writes one too), so later loads check them",
                        err=True)


@cli.command("bench")
@click.argument("workloads", nargs=-1)
@panels
@option("--workloads-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        envvar="STRATA_BENCH_WORKLOADS", panel=BENCH,
        help="Where the workload files are (default: the ones shipped in strata_cli/assets/workloads).")
@option("--modes", default=None, envvar="STRATA_BENCH_MODES", panel=BENCH,
        help="Comma-separated modes: serial, N, A-B, auto, auto:N, mlx-lm, mlx-lm-spec "
             "[default: serial,1-7,auto,mlx-lm,mlx-lm-spec].")
@option("--max-tokens", "-n", type=click.IntRange(min=1), default=None, envvar="STRATA_BENCH_TOKENS", panel=BENCH,
        help="Tokens generated per prompt, exactly: EOS is disabled [default: 128].")
@option("--repeats", "-r", type=click.IntRange(min=1), default=None, envvar="STRATA_BENCH_REPEATS", panel=BENCH,
        help="Measured runs per mode and workload [default: 3].")
@option("--warmup", type=click.IntRange(min=0), default=None, envvar="STRATA_BENCH_WARMUP", panel=BENCH,
        help="Warm-up runs per mode and workload, reported apart [default: 1].")
@SEED
@TEMPERATURE
@draft_options
@option("--peers/--no-peers", default=True, envvar="STRATA_BENCH_PEERS", show_default=True, panel=BENCH,
        help="Run the mlx-lm peer modes (needs the 'bench' extra).")
@option("--peer-draft-model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
        panel=BENCH, help="Draft model of mlx-lm-spec (default: the model itself).")
@option("--peer-draft-tokens", type=click.IntRange(min=1), default=2, show_default=True, panel=BENCH,
        help="Drafts per step of mlx-lm-spec.")
@option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None, panel=OUTPUT,
        help="Write every run and summary as JSON to FILE.")
@option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None, panel=OUTPUT,
        help="Draw tokens/s by mode and workload to a PNG (needs matplotlib, the 'bench' extra).")
@option("--check", is_flag=True, envvar="STRATA_BENCH_CHECK", panel=OUTPUT,
        help="Exit with status 1 when a speed target is missed (a diverged output always does).")
@option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path), default=None, panel=OUTPUT,
        help="Write the results table (and the speed targets) as Markdown to FILE, for docs/benchmarks.md.")
@model_options
@engine_options
def bench_command(workloads, workloads_dir, modes, max_tokens, repeats, warmup, seed, temperature, drafts,
                  peers, peer_draft_model, peer_draft_tokens, out_path, plot_path, check, markdown_path, load, engine):
    """Measure tokens/s of named WORKLOADS (default: all) in every decoding mode.

    Each workload runs in each mode (serial, fixed draft lengths, auto, and mlx-lm on the same
    checkpoint) with warm-up runs apart and medians over repeats; greedy outputs are checked to
    be identical across strata modes (a difference exits with status 1; with --check, so does
    a missed speed target). The table goes to stdout, progress to stderr (a bar on a terminal,
    a line per finished run otherwise). A workload or the mlx-lm peers that need the 'bench'
    extra are skipped with a note unless named. The plain `strata bench` takes about 6 minutes
    on a 2-core CPU with the demo model. docs/benchmarks.md explains every column.

    \b
    Examples:
      strata bench
      strata bench prose copy_edit --modes serial,1-4,auto --repeats 5 --out bench.json
      strata bench --no-peers --plot bench.png
      strata bench copy_edit --no-peers --temperature 0.7 --modes serial,3,auto
      strata bench prose copy_edit --modes serial,auto --check
    """
    from .bench import (
        DEFAULT_BENCH_TOKENS,
        DEFAULT_MODES,
        DEFAULT_REPEATS,
        DEFAULT_WARMUP,
        BenchOptions,
        PeerError,
        PlotError,
        parse_modes,
        require_matplotlib,
        require_mlx_lm,
    )
    from .bench.peers import PEER_MODES

    try:
        options = BenchOptions(
            max_tokens=max_tokens or DEFAULT_BENCH_TOKENS,
            repeats=repeats or DEFAULT_REPEATS,
            warmup=DEFAULT_WARMUP if warmup is None else warmup,
            seed=DEFAULT_SEED if seed is None else seed,  # bench is reproducible by default
            temperature=temperature,
        )
        mode_list = parse_modes(modes or DEFAULT_MODES, **drafts)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    if not peers:
        if modes and any(m.label in PEER_MODES for m in mode_list):
            raise click.BadParameter("--modes names mlx-lm modes but --no-peers leaves them out")
        mode_list = [m for m in mode_list if m.label not in PEER_MODES]
    if temperature > 0 and any(m.label in PEER_MODES for m in mode_list):
        raise click.BadParameter("mlx-lm modes decode greedily: with --temperature > 0 pass --no-peers "
                                 "or leave them out of --modes")
    notes: list[str] = []  # what was left out for want of an extra; printed now and kept in the results
    if any(m.label in PEER_MODES for m in mode_list):
        try:
            require_mlx_lm()
        except PeerError as e:
            if modes:
                raise UserError(str(e)) from None
            mode_list = [m for m in mode_list if m.label not in PEER_MODES]
            notes.append("mlx-lm peer modes skipped: mlx-lm is not installed (pip install 'strata-cli[bench]')")
    if plot_path:
        try:
            require_matplotlib()  # before the run, not after it
        except PlotError as e:
            raise UserError(str(e)) from None
    run_guarded(lambda: _bench(load, engine, list(workloads), workloads_dir, mode_list, options,
                               peer_draft_model, peer_draft_tokens, out_path, plot_path, markdown_path, check, notes))


def _bench(load, engine_options, names, workloads_dir, modes, options, peer_draft_model, peer_draft_tokens,
           out_path, plot_path, markdown_path, check, notes):
    import mlx.core as mx
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from .bench import (
        MlxLmPeer,
        PeerError,
        PlotError,
        WorkloadError,
        collect_meta,
        count_runs,
        default_workloads_dir,
        load_workloads,
        markdown,
        plot,
        render_table,
        run_bench,
    )

    err = make_console(stderr=True)
    try:
        directory = workloads_dir or default_workloads_dir()
        workloads = load_workloads(directory, names, notes=notes)
        for note in notes:
            click.echo(f"note: {note}", err=True)
        if not err.is_terminal:
            click.echo(f"bench: loading {load.model}", err=True)
        with err.status(f"loading {load.model}"):
            runtime = open_runtime(load, engine_options, announce=err.print)
            # auto modes without --draft-cost: the device's own cost curve (cached or measured now)
            modes = [replace(m, spec=runtime.spec_for(m.spec)) if m.spec else m for m in modes]
            peer = None
            if any(m.kind == "peer" for m in modes):
                peer = MlxLmPeer.load(runtime.path, dtype=runtime.dtype, draft_path=peer_draft_model,
                                      num_draft_tokens=peer_draft_tokens)
        meta = collect_meta(model=load.model, device=str(mx.default_device()), dtype=runtime.dtype_name,
                            options=options,
                            modes=modes, extra={"workloads": [w.name for w in workloads],
                                                "peer_draft_tokens": peer_draft_tokens, "notes": list(notes),
                                                "warmup_seconds": runtime.warmup_seconds,
                                                "kernel_cache": runtime.kernel_cache.as_dict(),
                                                "calibration_seconds": runtime.calibration_seconds,
                                                "cost_prior": {m.label: m.spec.cost_prior.source for m in modes
                                                               if m.spec and m.spec.cost_prior}})
        total = count_runs(workloads, modes, options)
        if err.is_terminal:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=err, transient=True) as bar:
                task = bar.add_task("bench", total=total)
                result = run_bench(runtime.engine, runtime.tokenizer, workloads, modes, options, peer=peer,
                                   meta=meta, progress=lambda what: bar.update(task, advance=1, description=what))
        else:  # a log: one line per finished run
            done, start = [0], time.monotonic()

            def log_run(what: str) -> None:
                done[0] += 1
                click.echo(f"bench {done[0]}/{total} ({time.monotonic() - start:.0f} s): {what}", err=True)

            result = run_bench(runtime.engine, runtime.tokenizer, workloads, modes, options, peer=peer,
                               meta=meta, progress=log_run)
        render_table(make_console(), result)
        if out_path:
            safe_files.write_text(out_path, json.dumps(result.to_dict(), indent=1) + "\n")
            err.print(f"wrote {out_path}")
        if plot_path:
            plot(result, plot_path)
            err.print(f"wrote {plot_path}")
        if markdown_path:
            safe_files.write_text(markdown_path, markdown(result))
            err.print(f"wrote {markdown_path}")
    except (WorkloadError, PeerError, PlotError) as e:
        raise UserError(str(e)) from None
    if result.diverged:
        raise UserError("output differs from serial in " + "; ".join(
            f"{w}: {', '.join(ms)}" for w, ms in result.diverged.items()))
    if result.missed:
        missed = "; ".join(f"{t.workload}: {t.rule} {t.ratio:.3f} < {t.threshold:.2f}" for t in result.missed)
        if check:
            raise UserError(f"missed speed targets: {missed}")
        click_core.echo(f"note: {len(result.missed)} speed target(s) missed ({missed}); the exit status is 0 "
                        "without --check", err=True)




@cli.command("selftest")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=64, envvar="STRATA_SELFTEST_TOKENS",
              show_default=True, help="Tokens generated per prompt and mode.")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPE_NAMES), multiple=True,
              help="Check only this dtype (repeatable) [default: float32 on the CPU, float32 and bfloat16 on a GPU].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--kernels", "kernels_only", is_flag=True,
              help="Only run every GPU kernel's start-up probe in each dtype and report it (seconds, no decoding).")
def selftest_command(max_tokens, dtypes, as_json, kernels_only):
    """Check that speculative decoding is lossless on this machine's backend.

    Runs the embedded demo model (GDN and attention layers) over built-in prompts, and a tiny
    random Mamba-2 hybrid (Nemotron-H: Mamba-2, attention and MoE layers) over fixed prompts of
    random token ids, serially and with --suffix-draft 3 and auto, in every dtype the backend
    computes in, and prints for each model, dtype, prompt and mode whether the output is
    identical to serial decoding (or where it first differs), then the demo model's cost of a
    window of T = 1..8 rows. Exits with status 1 on any difference.

    With --kernels it only runs each GPU kernel family's start-up probe (each row of a window
    equal to its one-row call bit for bit, and the kernel within tolerance of its reference) and
    reports which are in use; a family that fails falls back to MLX's ops (lossless, slower), and
    the exit status is 1. Off a GPU no kernel runs.

    \b
    Examples:
      strata selftest
      strata selftest --dtype bfloat16 --json
      strata selftest --kernels
    """
    if kernels_only:
        run_guarded(lambda: _kernel_probes(list(dtypes) or None, as_json))
    else:
        run_guarded(lambda: _selftest(max_tokens, list(dtypes) or None, as_json))


def _kernel_probes(dtypes, as_json):
    from rich.console import Console
    from rich.table import Table

    from .bench.selftest import probe_kernels

    with Console(stderr=True).status("selftest: probing the GPU kernels"):
        report = probe_kernels(dtypes)
    if as_json:
        click.echo(json.dumps(report))
    else:
        table = Table(title=f"kernel probes on {report['backend']}", title_justify="left")
        for column in ("kernels", "in use", "seconds", "error"):
            table.add_column(column)
        for key, entry in report["kernels"].items():
            used = ", ".join(d for d, ok in entry["usable_by_dtype"].items() if ok) or "no"
            table.add_row(key, used, f"{entry['seconds']:.2f}", entry["error"] or "")
        Console(width=max(100, Console().width)).print(table)
    failed = [key for key, entry in report["kernels"].items() if entry["error"] is not None]
    if failed:
        raise UserError(f"selftest: kernel probes failed on {report['backend']}: {', '.join(failed)} "
                        "(these run MLX's ops instead: lossless, slower)")


def _selftest(max_tokens, dtypes, as_json):
    from rich.console import Console
    from rich.table import Table

    from .bench.selftest import selftest

    err = Console(stderr=True)
    with err.status("selftest: decoding the demo model and a Mamba-2 hybrid serially and with drafts"):
        report = selftest(max_tokens=max_tokens, dtypes=dtypes)
    if as_json:
        click.echo(json.dumps(report))
    else:
        console = Console(width=max(100, Console().width))
        console.print(f"strata selftest on {report['backend']}")  # a line of its own: a title would wrap
        table = Table(title_justify="left")
        for column in ("model", "dtype", "prompt", "mode", "result"):
            table.add_column(column)
        for r in report["results"]:
            result = "identical" if r["identical"] else f"DIFFERS at token {r['first_difference']}"
            table.add_row(r["model"], r["dtype"], str(r["prompt"]), r["mode"], result)
        console.print(table)
        console.print("window of T rows, ms (median)")
        costs = Table()
        costs.add_column("T")
        for dtype in report["window_ms"]:
            costs.add_column(dtype, justify="right")
        for T in map(str, range(1, 9)):
            costs.add_row(T, *(f"{report['window_ms'][d][T]:.2f}" for d in report["window_ms"]))
        console.print(costs)
    if not report["passed"]:
        bad = sum(not r["identical"] for r in report["results"])
        raise UserError(f"selftest: {bad} of {len(report['results'])} runs differ from serial decoding "
                        f"on {report['backend']}")
    if not as_json:
        click_core.echo(f"selftest passed: all {len(report['results'])} runs identical to serial decoding "
                        f"on {report['backend']}")


def open_runtime(load, engine, **kwargs):
    """`runtime.open_model`; on a rank after the first of an `mlx.launch` pipeline, serve rank
    0's windows on this rank's layers until rank 0 ends, then exit (rank 0 does all output)."""
    from .runtime import open_model

    runtime = open_model(load, engine, **kwargs)
    if runtime.follower is not None:
        sys.exit(runtime.follower.serve())
    return runtime


def run_guarded(action) -> None:
    """Run `action`, turning library errors into one clear line and a non-zero exit."""
    from .convert import ConvertError
    from .decode import PromptError
    from .distributed import PipelineError
    from .engine.window import WindowError
    from .experts.store import ExpertStoreError
    from .model.loader import ModelLoadError
    from .serve.session import SessionError

    if raise_errors():
        action()
        return
    try:
        action()
    except (ModelLoadError, ConfigError, PromptError, WindowError, ConvertError, SessionError, ExpertStoreError,
            PipelineError) as e:
        raise UserError(str(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("terminated", err=True)
        sys.exit(143)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, and keep the exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except (ValueError, RuntimeError, OSError) as e:
        raise UserError(f"{type(e).__name__}: {e}") from None


def main() -> None:
    cli(prog_name="strata")


if __name__ == "__main__":
    main()
