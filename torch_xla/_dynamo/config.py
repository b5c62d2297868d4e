"""Settings of the dynamo bridge, read at each call of a compiled graph."""

# True: a compiled graph refuses inputs with pending IR instead of computing them first.
skip_input_data_check = False
