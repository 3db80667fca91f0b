"""``python -m mixprec`` (and ``torchrun -m mixprec``) run the CLI."""

from mixprec.cli import main

raise SystemExit(main())
