import sys

from examples.serving.run import main

sys.exit(main())
