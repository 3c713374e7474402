"""The model: plain records that flow between the layers (readings -> findings -> results); imports nothing
of the package but itself. (Empty: importing a layer loads none of its modules.)"""

