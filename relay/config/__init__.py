"""The configuration: every key of relay.yaml on a pydantic model, loaded once into a frozen
tree, every error of a file reported at once. Nothing here imports delivery/, spool/, ops/
or inbound/: the values they read from the config live here.

- tree.py       the entry point: load_config / from_mapping, DEFAULTS, json_schema
- models.py     the registry of the section models (sections/: one module per room) and
                the model of the whole file (its JSON Schema is `relay config schema`)
- values.py     value types: durations, sizes, rates, percentages, host:port, nameservers
- report.py     ConfigError and the error lines (key paths, did-you-mean)
- build.py      from the validated sections to the tree: the checks between sections
- records.py    the frozen tree the rest of the code reads (Config, Limits, ...)
- routes.py     upstreams and routes: their models and values (relay/delivery reads them)
- rules.py      lane rules and shaping rules: parsed values (relay/delivery reads them)
- users.py      the users files (SMTP AUTH, the console)
- redact.py     how secrets print (URLs, DSNs) and the config's own secrets
- credentials.py  ${CREDENTIALS_DIRECTORY} in file keys (systemd LoadCredential=)
"""
