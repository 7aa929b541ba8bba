#!/usr/bin/env python
"""Translate raw text with a trained run (tinytf.commands.translate; installed as tinytf-translate).

``python translate.py --help`` lists the options; the program is :mod:`tinytf.commands.translate`.
"""
import sys

from tinytf.commands.translate import main

if __name__ == "__main__":
    sys.exit(main())
