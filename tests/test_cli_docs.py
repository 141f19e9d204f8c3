"""docs/cli.md is the option reference: generated from the click commands, never edited by hand."""

from scripts import cli_docs


def test_the_option_reference_is_current():
    assert cli_docs.TARGET.read_text() == cli_docs.render(), "docs/cli.md is stale: run python -m scripts.cli_docs"


def test_every_option_of_every_command_is_in_the_reference():
    import click

    from strata_cli.cli import cli

    text = cli_docs.render()
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        assert f"## strata {name}" in text
        for param in cli.get_command(ctx, name).params:
            if isinstance(param, click.Option) and not param.hidden:
                assert all(f"`{flag}`" in text for flag in param.opts), (name, param.opts)


def test_the_stats_glossary_is_current_and_covers_every_figure():
    from strata_cli.telemetry import EXPERT_FIELDS, FIELDS, DecodeStats, WindowRecord

    assert cli_docs.STATS.read_text() == cli_docs.render_stats(), "docs/stats.md is stale: run python -m scripts.cli_docs"
    stats = DecodeStats()
    stats.record_window(WindowRecord(T=2, keep=2, emitted=2, seconds=0.01, match_length=5, proposed=1))
    summary = stats.summary()
    assert set(summary) - {"experts"} <= set(FIELDS)
    from strata_cli.telemetry import ExpertWindowStats

    stats.record_window(WindowRecord(T=1, keep=1, emitted=1, seconds=0.01, experts=ExpertWindowStats()))
    experts = stats.summary()["experts"]
    assert set(experts) - {"per_layer", "moce"} <= set(EXPERT_FIELDS)


def test_stats_show_units_and_no_ratio_without_data():
    from strata_cli.telemetry import FIELDS, DecodeStats, readable_rows

    rows = {key: value for key, _, value in readable_rows(DecodeStats().summary(), FIELDS)}
    assert rows["acceptance"] == rows["tokens_per_window"] == rows["window_ms_mean"] == "n/a"
    assert rows["prompt_tokens"] == "0 tokens" and rows["decode_seconds"].endswith(" s")
