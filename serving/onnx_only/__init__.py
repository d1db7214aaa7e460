"""serve.py for ONNX exports without torch or torchvision (the slim serving image: onnxruntime, Pillow,
NumPy, FastAPI/uvicorn): the export's eval preprocessing in PIL and NumPy, onnxruntime's session, and the
rows serve.py gives for the same export on its torch path (calibrated `prob`, the energy reject option,
multi-label tags), served by the same HTTP app (serving.app) and server (serving.server.GracefulServer)."""
