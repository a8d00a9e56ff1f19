"""Inbound SMTP: our SMTP server and everything it decides.

The sans-I/O protocol core (`core`), the asyncio transport (`transport`), the session
state (`session`), the accept step's decisions (`handler`), DATA as it arrives (`dataflow`,
`longlines`), AUTH (`auth`, `auth_mechanisms`), the per-IP and per-connection limits
(`anvil`, `guard`, `session_limits`, `session_watch`, `fdlimit`), implicit TLS
(`tls_listener`) and the inbound processes (`processes`). Import from the modules; this
package file imports nothing, so importing one of them never loads the rest.
"""
