"""`nsaserve bench`: an async load generator for OpenAI-compatible servers (ours or any other).

Layout: `client` speaks HTTP/1.1 and SSE, `datasets` builds the requests, `openai_api` turns them
into request bodies and reads responses, `runner` paces them, `metrics` and `server_metrics`
compute the numbers, `report` and `plot` write them, `args` and `main` are the command line.
"""
