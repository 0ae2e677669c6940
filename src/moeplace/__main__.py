import sys

from moeplace.cli import main

sys.exit(main())
