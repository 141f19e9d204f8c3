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
