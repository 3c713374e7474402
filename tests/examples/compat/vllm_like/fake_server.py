import http.server
import multiprocessing
import os
import signal
import sys
import time

from pytest_gpuclean.simulate import allocate


def engine(sim):
    allocate(sim, 0, 200)
    while True:
        time.sleep(1)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(target=engine, args=(os.environ["GPUCLEAN_SIMULATE"],), daemon=True)
    core.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit through atexit: daemonic children end
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()
