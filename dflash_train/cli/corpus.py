"""The committed SmolLM2 corpus: ShareGPT first turns answered by SmolLM2-135M-Instruct itself.

    make real-target && OMP_NUM_THREADS=1 python -m dflash_train.cli.corpus --conversations 3000 \
        --chunk 128 --slots 64

is the command that built the committed corpus (then spelled `python -m dflash_train.data.corpus`, which
now says where it went). Extending it takes the same --chunk (part of the resume key; --slots may change);
a rerun with nothing to do writes nothing. The builder, its output and resume: data/corpus.py.
"""

from pathlib import Path

from dflash_train.cli import defaults_of
from dflash_train.core.errors import OneLineArgumentParser, cli_guard
from dflash_train.data.corpus import CorpusSettings, build_corpus


def parse_args(argv=None) -> CorpusSettings:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real", type=Path, help="make real-target's folder")
    p.add_argument("--output", type=Path)
    p.add_argument("--conversations", type=int, help="prompts to answer in all (appends)")
    p.add_argument("--max-prompt-tokens", type=int)
    p.add_argument("--max-new-tokens", type=int, help="per answer; a cut answer is kept, marked")
    p.add_argument("--chunk", type=int,
                   help="prompts per resumable chunk; part of the resume key (the committed corpus: 128)")
    p.add_argument("--slots", type=int, help="answers decoded together")
    p.set_defaults(**defaults_of(CorpusSettings))  # stated once, in CorpusSettings
    args = p.parse_args(argv)
    for name in ["conversations", "max_prompt_tokens", "max_new_tokens", "chunk", "slots"]:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return CorpusSettings(**vars(args))


@cli_guard
def main(argv=None):
    build_corpus(parse_args(argv))


if __name__ == "__main__":
    main()
