"""The commands: `relay` (`main`), `relay-sendmail` and `mailq` (`sendmail`), and the
generator of the reference pages and man pages (`docsgen`)."""
