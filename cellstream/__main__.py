import sys

from cellstream.cli.main import main

sys.exit(main())
