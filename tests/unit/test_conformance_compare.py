"""./dev torch-suite's verdict: the tests gloo passes that aggnet does not,
with the name checks a redirected run cannot pass set apart."""

import pathlib
import subprocess
import sys

COMPARE = pathlib.Path(__file__).resolve().parents[1] / "conformance" / "compare.py"


def junit(path: pathlib.Path, outcomes: dict[str, str]) -> str:
    cases = "".join(f'<testcase name="{name}">' + {"passed": "", "failed": '<failure message="x"/>',
                                                      "skipped": '<skipped message="x"/>'}[what] + "</testcase>"
                    for name, what in outcomes.items())
    path.write_text(f'<testsuites><testsuite name="s">{cases}</testsuite></testsuites>')
    return str(path)


def compare(tmp_path, gloo, aggnet):
    files = [junit(tmp_path / "g.xml", gloo), junit(tmp_path / "a.xml", aggnet)]
    r = subprocess.run([sys.executable, str(COMPARE), *files], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout


def test_a_test_gloo_passes_and_aggnet_fails_fails_the_comparison(tmp_path):
    rc, out = compare(tmp_path, {"test_a": "passed", "test_b": "passed", "test_c": "skipped"},
                      {"test_a": "passed", "test_b": "failed", "test_c": "skipped"})
    assert rc == 1
    assert "gloo passes 2 of 3 tests here; through aggnet 1 of them pass" in out and "failed: test_b" in out


def test_the_backend_name_check_is_named_and_does_not_fail_it(tmp_path):
    rc, out = compare(tmp_path, {"test_a": "passed", "test_get_backend": "passed"},
                      {"test_a": "passed", "test_get_backend": "failed"})
    assert rc == 0
    assert "test_get_backend (asserts dist.get_backend() == 'gloo')" in out


def test_what_gloo_skips_does_not_count(tmp_path):
    rc, out = compare(tmp_path, {"test_a": "skipped"}, {"test_a": "failed"})
    assert rc == 0 and "gloo passes 0 of 1" in out
