"""The modes of `pwctl bench`, one module each: `run(...)` takes the options the mode reads (by
name, as the command declares them) and prints its tables. pwctl/commands/bench.py picks one
from its dispatch table; the parameters of a mode's `run` are the options it accepts.

Like the commands, a mode imports torch, transformers and the bench code in its body."""
