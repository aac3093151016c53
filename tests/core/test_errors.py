"""core/errors.py: a UserError from a command is one `error:` line and exit 2, Ctrl-C one line and exit
130, a bad flag one line (no usage dump); under a launcher only local rank 0 says a shared line, and
another rank that meets an error waits for the launcher to stop it before saying its own."""

import pytest

from conftest import run_main
from dflash_train.core.errors import Interrupted, OneLineArgumentParser, UserError, cli_guard


def raising(exc):
    @cli_guard
    def main(argv=None):
        raise exc
    return main


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_a_user_error_is_one_line_and_exit_2(rank0):
    rc, out, err = run_main(raising(UserError("--data 'x' not found")), [])
    assert (rc, out, err) == (2, "", "error: --data 'x' not found\n")


def test_a_normal_return_passes_through(rank0):
    assert cli_guard(lambda argv=None: 7)([]) == 7


@pytest.mark.parametrize("exc, line", [(KeyboardInterrupt(), "interrupted"),
                                       (Interrupted("interrupted at step 7; rerun it"),
                                        "interrupted at step 7; rerun it")])
def test_ctrl_c_is_one_line_after_a_newline_and_exit_130(rank0, exc, line):
    assert run_main(raising(exc), []) == (130, "", f"\n{line}\n")


def test_other_errors_are_not_swallowed(rank0):
    with pytest.raises(ZeroDivisionError):
        raising(ZeroDivisionError())([])


def test_an_error_only_another_local_rank_meets_is_still_said(monkeypatch, capsys):
    """Local rank 0 says the error every process meets. Another rank waits first (so the launcher,
    stopping it once rank 0 exits, cannot cut rank 0 off), then says its own: one only it met."""
    from dflash_train.core import errors

    waited = []
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    fail = errors.cli_guard(lambda: (_ for _ in ()).throw(errors.UserError("shard 3 is empty")))
    for rank, wait in [("0", []), ("1", [errors.OTHER_RANKS_WAIT_S])]:
        monkeypatch.setenv("LOCAL_RANK", rank)
        waited.clear()
        with pytest.raises(SystemExit) as e:
            fail()
        assert e.value.code == 2 and waited == wait
        assert capsys.readouterr().err == "error: shard 3 is empty\n"


def test_ctrl_c_on_another_rank_is_left_to_rank_0(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_main(raising(KeyboardInterrupt()), []) == (130, "", "")  # rank 0 says it for the machine


def test_a_bad_flag_is_one_line_naming_the_program(rank0):
    p = OneLineArgumentParser(prog="dflash-x")
    p.add_argument("--n", type=int)
    assert run_main(p.parse_args, ["--n", "two"]) == (
        2, "", "error: dflash-x: argument --n: invalid int value: 'two'\n")
    assert p.parse_args(["--n", "2"]).n == 2
