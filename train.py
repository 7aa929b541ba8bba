#!/usr/bin/env python
"""Train a Transformer on parallel text (tinytf.commands.train; installed as tinytf-train).

``python train.py --help`` lists the options; the program is :mod:`tinytf.commands.train`.
"""
import sys

from tinytf.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
