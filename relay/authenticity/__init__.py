"""Authenticity of the mail we send: DKIM signing (`dkim`), RFC 8058 one-click unsubscribe
(`unsubscribe`), MTA-STS policies (`mtasts`) and `relay check-dns` (`checkdns`)."""
