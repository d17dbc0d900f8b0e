"""How long a client may take over the slow steps of a request, the same on both edges."""

# A request's body (JSON) or message (gRPC) must arrive whole within this of when it is
# asked for: a client that starts one and stops holds its place and its room no longer.
BODY_TIMEOUT_S = 30.0
# An answer (a JSON response, a gRPC stream message) its client takes nothing of for this
# long ends the connection (JSON) or the call (gRPC), and with it what it held.
SEND_STALL_S = 30.0
