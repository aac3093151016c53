"""evaluation/report.py: a report.json is read only if it has the shape dflash-eval writes (what export
matches against a drafter), else one line naming the file and the field; the words report.md uses."""

import json

import pytest

from dflash_train.core.errors import UserError
from dflash_train.evaluation.report import dtype_label, plural, read_report
from helpers.reports import fake_report


def written(tmp_path, report) -> str:
    path = tmp_path / "report.json"
    path.write_text(report if isinstance(report, str) else json.dumps(report))
    return str(path)


def test_a_report_as_dflash_eval_writes_it_reads_back_unchanged(tmp_path):
    report = fake_report("ab" * 32)
    assert read_report(written(tmp_path, report)) == report


def changed(edit):
    report = fake_report("ab" * 32)
    edit(report)
    return report


@pytest.mark.parametrize("report, names", [
    ("{not json", "is not a readable dflash-eval report.json"),
    (changed(lambda r: r["results"][1].update(tau="high")), "tau"),
    (changed(lambda r: r["results"][0].update(prompts=0)), "prompts"),
    (changed(lambda r: r.update(results=[])), "results"),
    (changed(lambda r: r["advice"].update(other=r["advice"]["tinychat"])), "are not advice's suites"),
    (changed(lambda r: r["advice"]["tinychat"]["measured"].update(recommended=None)),
     "at least two indistinguishable"),
    (changed(lambda r: r.pop("hardware")), "hardware")])
def test_a_report_of_another_shape_is_one_line_naming_the_field(report, names, tmp_path):
    path = written(tmp_path, report)
    with pytest.raises(UserError) as e:
        read_report(path)
    line = str(e.value)
    assert "\n" not in line and path in line and names in line


def test_the_words_of_report_md():
    assert [plural(n, "prompt") for n in (0, 1, 2)] == ["0 prompts", "1 prompt", "2 prompts"]
    assert [dtype_label(d) for d in ("float32", "bfloat16", "bf16-weights", "float16")] == [
        "fp32", "bf16", "bf16 weights, fp32 activations", "float16"]
