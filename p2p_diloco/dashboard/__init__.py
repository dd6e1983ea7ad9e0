"""`p2p-diloco dashboard`: a live, offline web view of a whole run (collector, HTTP server, page)."""
