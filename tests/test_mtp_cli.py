"""--mtp where users reach it: python -m mlx_lily generate --mtp drafts with
the head and prints plain greedy's text; a checkpoint without a head says so
in one line naming graft-mtp and decodes without drafts; the server serves
requests one at a time while the model has a head; doctor --model says
whether the checkpoint has one."""

from __future__ import annotations

import pytest
from mlx_lm.generate import generate

import mlx_lily
from mlx_lily import __main__ as cli
from mlx_lily import mtp_cli, mtp_decode
from mlx_lily._notice import reset_notices
from mlx_lily.random_checkpoints import make_checkpoint

ARGS = ["--prompt", "hello there", "--max-tokens", "10", "--ignore-chat-template"]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mtp-cli") / "h", mtp=True)


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setattr(mtp_decode, "cli_draft_tokens", None)
    calls = []
    real = mtp_decode.mtp_generate_step

    def counting(*args, **kwargs):
        calls.append(kwargs["num_draft_tokens"])
        yield from real(*args, **kwargs)

    monkeypatch.setattr(mtp_decode, "mtp_generate_step", counting)
    reset_notices()
    yield calls
    reset_notices()


def _text(out: str) -> str:
    return out.split("==========")[1]


def test_generate_mtp_drafts_and_prints_greedy_text(head, spy, capsys, monkeypatch):
    import importlib

    generate_module = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(generate_module, "make_sampler", generate_module.make_sampler)
    model, tokenizer = mlx_lily.load(str(head))
    want = generate(model, tokenizer, "hello there", max_tokens=10, verbose=True)
    plain = capsys.readouterr().out
    cli.main(["generate", "--mtp", "--num-draft-tokens", "2", "--model", str(head), "--verbose", "True"] + ARGS)
    out = capsys.readouterr()
    assert spy == [2] and _text(out.out) == _text(plain) and want
    assert "MTP head" not in out.err
    from mlx_lily import mtp_sampling

    assert isinstance(generate_module.make_sampler(0.7), mtp_sampling.Sampler)


def test_a_checkpoint_without_a_head_says_how_to_graft(demo_checkpoint, spy, capsys):
    cli.main(["generate", "--mtp", "--model", str(demo_checkpoint), "--verbose", "True"] + ARGS)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "--mtp" in line]
    assert len(lines) == 1 and "no MTP head" in lines[0] and "graft-mtp" in lines[0]
    assert spy == []


def test_mtp_needs_lily(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--backend", "mlx", "--mtp"] + ARGS)
    assert "--mtp needs --backend lily" in capsys.readouterr().err


def test_the_server_serves_one_at_a_time_with_a_head(head, demo_checkpoint, spy, monkeypatch):
    from mlx_lm.server import ResponseGenerator

    monkeypatch.setattr(ResponseGenerator, "_is_batchable", ResponseGenerator._is_batchable)
    monkeypatch.setattr(mtp_decode, "cli_draft_tokens", 1)

    class Provider:
        is_batchable = True

    class Args:
        seed = None

    class Generator:
        model_provider = Provider()
        cli_args = type("CliArgs", (), {"kv_bits": None})()

    with_head, _ = mlx_lily.load(str(head))
    mtp_cli.loaded(with_head, head, "mlx_lm.server")
    Provider.model = with_head
    assert ResponseGenerator._is_batchable(Generator(), Args()) is False
    Provider.model, _ = mlx_lily.load(str(demo_checkpoint))
    assert ResponseGenerator._is_batchable(Generator(), Args()) is True


def test_num_draft_tokens_from_argv():
    assert mtp_cli.draft_tokens_in(["--model", "m"]) == 1
    assert mtp_cli.draft_tokens_in(["--num-draft-tokens", "3"]) == 3
    assert mtp_cli.draft_tokens_in(["--num-draft-tokens=2"]) == 2
    argv = ["--mtp", "--model", "m"]
    assert mtp_cli.take_flag(argv) and argv == ["--model", "m"]


def test_doctor_says_whether_there_is_a_head(head, demo_checkpoint):
    assert "MTP head (1 layer)" in mtp_cli.head_line(str(head))
    line = mtp_cli.head_line(str(demo_checkpoint))
    assert "no MTP head" in line and "graft-mtp" in line


def test_python_m_mlx_lm_generate_drafts_on_its_own_module(monkeypatch, run_as_main):
    """``python -m mlx_lm.generate --mtp``: the program is ``__main__``, whose
    ``generate_step`` its ``stream_generate`` calls; the wrapper goes there,
    not to a second copy of ``mlx_lm.generate``."""
    import importlib

    from mlx_lily import mtp_decode

    def generate_step(*args, **kwargs):  # the program's own
        yield from ()

    main = run_as_main("mlx_lm.generate", generate_step=generate_step)
    monkeypatch.setattr(mtp_decode, "_stock_generate_step", mtp_decode._stock_generate_step)
    imported = importlib.import_module("mlx_lm.generate")
    before = imported.generate_step
    mtp_decode.install()
    assert main.generate_step is mtp_decode.generate_step
    assert mtp_decode._stock_generate_step is generate_step
    assert imported.generate_step is before  # the copy the program never calls
