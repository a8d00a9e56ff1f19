"""The operator console (README "Console"): app.py serves it on the admin listener;
auth.py holds users, sessions and CSRF; rollup.py the per-minute series; html.py the
escaping, the templates and the charts. (Nothing imported here: relay/config/tree.py reads
auth.py's users file without loading the web parts.)"""
