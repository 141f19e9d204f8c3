"""The `strata` command: parse options, call the library, render. Nothing else lives here."""

from __future__ import annotations

import json
import os
import sys
from importlib.resources import files
from pathlib import Path

import click

from . import __version__
from .config import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_MATCH,
    DEFAULT_SEED,
    FOLD_MODES,
    MAX_SUFFIX_DRAFT,
    ConfigError,
    EngineOptions,
    GenerateOptions,
    SpecOptions,
)

DEMO_MODEL = "demo"  # the --model value that names the embedded checkpoint


def embedded_model_path() -> Path:
    return Path(str(files("strata_cli") / "assets" / "demo"))


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
        if prompt is None and sys.stdin.isatty():
            raise UserError("no prompt: pass PROMPT or pipe text on stdin")
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="strata")
def cli():
    """strata: sparse Mixture-of-Experts models on MLX, with lossless suffix-lookup
    speculative decoding.

    Every option can also be set with a STRATA_* environment variable
    (for example STRATA_MODEL, STRATA_SUFFIX_DRAFT).
    """


@cli.command()
@click.argument("prompt", required=False)
@click.option(
    "--model", "-m", default=DEMO_MODEL, envvar="STRATA_MODEL", show_default=True,
    help="Checkpoint directory (config.json, *.safetensors, tokenizer.json); 'demo' is the embedded model.",
)
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS,
              envvar="STRATA_MAX_TOKENS", show_default=True, help="Most tokens to generate per prompt.")
@click.option("--temperature", "-t", type=click.FloatRange(min=0.0), default=0.0,
              envvar="STRATA_TEMPERATURE", show_default=True, help="0 is greedy; above 0 samples.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=DEFAULT_SEED, envvar="STRATA_SEED",
              show_default=True, help="Seed for sampling (each prompt uses its own sampler).")
@click.option("--suffix-draft", type=click.IntRange(0, MAX_SUFFIX_DRAFT), default=0,
              envvar="STRATA_SUFFIX_DRAFT", show_default=True,
              help="At most N suffix-lookup drafts per window (0 = off). Greedy output is identical either way.")
@click.option("--min-match", type=click.IntRange(min=3), default=DEFAULT_MIN_MATCH, envvar="STRATA_MIN_MATCH",
              show_default=True, help="Shortest suffix match (tokens) that may propose drafts.")
@click.option("--stats", is_flag=True, envvar="STRATA_STATS", help="Print decode telemetry to stderr.")
@click.option("--json", "as_json", is_flag=True, envvar="STRATA_JSON",
              help="Print one JSON object per prompt (text, token_ids, finish_reason, stats) instead of streaming text.")
@click.option("--each-line", is_flag=True, envvar="STRATA_EACH_LINE",
              help="Treat every non-empty stdin line as its own prompt.")
@click.option("--max-context", type=click.IntRange(min=2), default=None, envvar="STRATA_MAX_CONTEXT",
              help="Positions the engine may hold (prompt + output); default: the model's maximum.")
@click.option("--fold", type=click.Choice(FOLD_MODES), default="lazy", envvar="STRATA_FOLD", show_default=True,
              help="When kept GDN rows fold into the recurrent state: at the next window (lazy) or at commit (eager).")
@click.option("--partial/--no-partial", default=False, envvar="STRATA_PARTIAL", show_default=True,
              help="Commit each window's root row inside the run.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              envvar="STRATA_DTYPE", help="Compute dtype (default: the checkpoint's; float32 on CPU).")
def generate(prompt, model, max_tokens, temperature, seed, suffix_draft, min_match, stats, as_json,
             each_line, max_context, fold, partial, dtype):
    """Generate text from PROMPT (or from stdin when piped, or when PROMPT is '-').

    \b
    Examples:
      strata generate "def fibonacci(n):"
      cat edit_request.txt | strata generate --suffix-draft 3 --max-tokens 200
      strata generate --each-line --json < prompts.txt
    """
    try:
        engine_options = EngineOptions(fold=fold, partial=partial, max_context=max_context, dtype=dtype)
        gen_options = GenerateOptions(max_tokens=max_tokens, temperature=temperature, seed=seed)
        spec = SpecOptions(max_drafts=suffix_draft, min_match=min_match)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    prompts = read_prompts(prompt, each_line)
    run_guarded(lambda: _generate(model, prompts, engine_options, gen_options, spec, stats, as_json))


def _generate(model_arg, prompts, engine_options, gen_options, spec, show_stats, as_json):
    from rich.console import Console

    from .decode import generate as decode_generate
    from .engine.window import WindowEngine
    from .model import load_model
    from .telemetry import DecodeStats
    from .tokenizer import StreamingDetokenizer, Tokenizer

    path = embedded_model_path() if model_arg == DEMO_MODEL else Path(model_arg)
    model = load_model(path, dtype=engine_options.dtype)
    tokenizer = Tokenizer(path)
    engine = WindowEngine(model, engine_options)
    console = Console(stderr=True)
    out = sys.stdout
    for n, text in enumerate(prompts):
        stats = DecodeStats()
        detok = StreamingDetokenizer(tokenizer)
        finish = None
        for step in decode_generate(
            engine, tokenizer.encode(text), options=gen_options, spec=spec,
            eos_ids=tokenizer.eos_ids, stats=stats,
        ):
            delta = detok.add(step.tokens)
            if not as_json and delta:
                out.write(delta)
                out.flush()
            finish = step.finish_reason or finish
        tail = detok.finish()
        for message in stats.notes:
            click.echo(f"note: {message}", err=True)
        if as_json:
            summary = stats.summary()
            record = {
                "text": tokenizer.decode(detok.ids),
                "token_ids": detok.ids,
                "finish_reason": finish,
                "stats": summary,
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write(tail + "\n")
        out.flush()
        if show_stats:
            stats.render(console, title=f"strata decode, prompt {n + 1}/{len(prompts)}")


def run_guarded(action) -> None:
    """Run `action`, turning library errors into one clear line and a non-zero exit."""
    from .decode import PromptError
    from .engine.window import WindowError
    from .model import ModelLoadError

    if raise_errors():
        action()
        return
    try:
        action()
    except (ModelLoadError, ConfigError, PromptError, WindowError) as e:
        raise UserError(str(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
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
