"""The mail vocabulary every room shares (pure): SMTP paths (`address`), RFC 5322 address
lists as written (`addrlist`), raw message bytes and the headers we add (`message`), and the
linear-time guard on operator-supplied regular expressions (`regex_guard`)."""
