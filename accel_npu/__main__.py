import sys

from accel_npu.cli import main

sys.exit(main())
