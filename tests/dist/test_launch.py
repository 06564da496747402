"""`edge0 launch`: its refusals are one line naming the flag, before anything starts."""

import pytest

from edge0.cli import main


@pytest.mark.parametrize("argv, says", [
    (["--", "chat"], "name the command to run across ranks after --: run or serve"),
    (["-n", "1", "--", "run"], "-n 1: from 2 to 64 ranks"),
    (["--", "run"], "give -n N (ranks on this machine) or --hostfile FILE"),
    (["-n", "2", "--hostfile", "hosts.json", "--", "run"], "give -n N (ranks on this machine) or --hostfile FILE"),
    (["--hostfile", "no/such/hosts.json", "--", "run"], "--hostfile no/such/hosts.json: no such file"),
    (["-n", "2", "--port", "80", "--", "run"], "--port 80: from 1024 to 65000"),
    (["-n", "2", "--split", "2,x", "--", "run"], "--split 2,x: choose even, cost or layer counts such as 3,3"),
    (["-n", "2", "--rank-timeout", "0", "--", "serve"], "--rank-timeout 0: seconds, more than 0 and at most 86400"),
])
def test_refusals(argv, says, capsys):
    assert main(["launch", *argv]) != 0
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
