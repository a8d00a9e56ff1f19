"""Operations: what the operator and the outside world reach over HTTP (relay/ops/http.py)."""
