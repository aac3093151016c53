"""export/writer.py: the eval reports an export takes (only those that measured this very drafter, at
its block size, against its verifier; with --dtype bf16, its rounded weights) and the Hub push's dry run."""

import json

from conftest import TINY_TARGET, error_line, run_main
from dflash_train.checkpoint.folders import drafter_fingerprint, load_drafter
from dflash_train.cli.export import main
from dflash_train.core.outputs import MARKER
from dflash_train.export.writer import round_to_bf16
from helpers.reports import fake_report


def exits_2(argv) -> str:
    code, _, stderr = run_main(main, argv)
    assert code == 2, stderr[-2000:]
    return error_line(stderr)


def test_dry_run_lists_exactly_the_files(trained_drafter_dir, tmp_path, capsys):
    main(["--format", "speculators", "--checkpoint", str(trained_drafter_dir), "--output",
          str(tmp_path / "o"), "--push-to-hub", "me/tiny-dflash", "--private", "--dry-run"])
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("dry run"))
    assert "private model repo 'me/tiny-dflash'" in out[start]
    listed = sorted(line.split()[0] for line in out[start + 1:] if line.startswith("  "))
    on_disk = sorted(str(p.relative_to(tmp_path / "o")) for p in (tmp_path / "o").rglob("*") if p.is_file()
                     and p.name != MARKER)  # our marker stays local
    assert listed == on_disk and "model.safetensors" in listed and "README.md" in listed


def test_only_reports_of_this_drafter_target_and_block_size_go_into_the_card(fresh_drafter_dir, tmp_path):
    good = fake_report(drafter_fingerprint(load_drafter(fresh_drafter_dir)[0]))
    report = tmp_path / "report.json"
    base = ["--format", "dflash", "--checkpoint", str(fresh_drafter_dir), "--eval-report", str(report)]
    for change, message in [({"drafter_fingerprint": None},
                             "has no drafter_fingerprint (written by an older"),
                            ({"drafter_fingerprint": "0" * 64},
                             "measured another drafter (fingerprint 000000000000"),
                            ({"block_size": 16}, "was measured at block size 16, this checkpoint has 8"),
                            ({"target": "Qwen/Qwen3-8B"},
                             "was measured against target 'Qwen/Qwen3-8B', not the "
                                                          f"verifier '{TINY_TARGET}'")]:
        report.write_text(json.dumps({**good, **change}))
        assert message in exits_2([*base, "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    # the same target spelt another way, and the same drafter in another format, are accepted
    report.write_text(json.dumps({**good, "target": "data/tiny-target/"}))
    main([*base, "--output", str(tmp_path / "o")])
    main(["--format", "speculators", "--checkpoint", str(tmp_path / "o"), "--eval-report", str(report),
          "--output", str(tmp_path / "o2")])
    assert "| ddtree | 64 | 5.1234 | yes |" in (tmp_path / "o2" / "README.md").read_text()



def test_a_bf16_export_takes_only_reports_of_its_rounded_weights(trained_drafter_dir, tmp_path):
    drafter = load_drafter(trained_drafter_dir)[0]
    fp32 = round_to_bf16(drafter)
    rounded = drafter_fingerprint(drafter)
    assert fp32 != rounded
    for name, fingerprint in [("fp32", fp32), ("bf16", rounded)]:
        (tmp_path / f"{name}.json").write_text(json.dumps(fake_report(fingerprint)))
    args = ["--format", "speculators", "--checkpoint", trained_drafter_dir, "--dtype", "bf16"]
    rc, _, err = run_main(main, [*args, "--eval-report", tmp_path / "fp32.json", "--output",
                                        tmp_path / "a"])
    assert rc == 2 and "fp32 weights" in error_line(err) and not (tmp_path / "a").exists()
    rc, _, err = run_main(main, [*args, "--eval-report", tmp_path / "bf16.json", "--output",
                                        tmp_path / "b"])
    assert rc == 0, err
    assert drafter_fingerprint(load_drafter(tmp_path / "b")[0]) == rounded  # what its report measured

