"""The command-line programs, installed as commands by ``pip install``:

- ``tinytf-train`` (:mod:`.train`; ``python train.py`` in a checkout),
- ``tinytf-translate`` (:mod:`.translate`; ``python translate.py``),
- ``tinytf-average`` (:mod:`.average`: average a run's last checkpoints),
- ``tinytf-bpe`` (:mod:`tinytf.text.cli`: learn, encode, decode).

Each ``main(argv)`` returns the exit status: 0 done, 1 internal error (a traceback), 2 usage
or data error (one line naming the file), 128 + N stopped by signal N (141: a closed pipe).
"""
