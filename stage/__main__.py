import sys

from stage.cli import main

sys.exit(main())
