from tracerl.cli import main
from tracerl.cli.args import exit_process

exit_process(main())
