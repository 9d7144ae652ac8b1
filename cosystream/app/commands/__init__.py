"""The ``cosystream`` commands, a module each: ``add_parser(commands, parents)`` adds the command and its
flags to the top-level parser (``cosystream.app.cli``), ``run(args)`` carries it out and returns the exit
status. ``common`` holds what several commands read from their flags."""
