"""One module per subcommand: `tunekit NAME ARGS` runs tunekit.commands.NAME.main(ARGS).

Owns: argument parsing and the one-line error contract (parse), Hydra composition of the train
config tree (compose), and each command (train, eval, generate, chat, export, plan, doctor), plus
the fork server the doctor uses to run commands as children. The top of the import order: a
command may import any other package of tunekit; nothing outside this package imports it.
"""
