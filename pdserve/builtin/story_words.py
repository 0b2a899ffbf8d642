"""Word banks and facts for `pdserve.builtin.story_corpus` (written for pdserve; Apache-2.0).

Plain data: names with their pronouns, things, places, feelings, and short facts about
everyday topics in the simple style of children's books. The generator combines them.
"""

from __future__ import annotations

# (name, subject pronoun, object pronoun, possessive)
GIRLS = ("Lily", "Mia", "Anna", "Zoe", "Emma", "Sara", "Lucy", "Ella", "Rose", "Amy",
         "Kate", "Nora", "Ruby", "Daisy", "Maya", "Sophie", "Grace", "Chloe", "Jane", "Molly")
BOYS = ("Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Noah", "Finn", "Oliver",
        "Jake", "Luke", "Adam", "Paul", "Eli", "Harry", "Owen", "Theo", "Dan", "Peter")

ANIMALS = ("cat", "dog", "bird", "rabbit", "fox", "bear", "duck", "frog", "mouse", "owl",
           "horse", "cow", "pig", "sheep", "turtle", "squirrel", "lion", "puppy", "kitten",
           "goat", "hen", "deer", "bunny", "dragon", "monkey", "elephant")
ANIMAL_SOUNDS = {"cat": "meow", "dog": "woof", "bird": "tweet", "duck": "quack", "frog": "ribbit",
                 "cow": "moo", "pig": "oink", "sheep": "baa", "owl": "hoot", "puppy": "woof",
                 "kitten": "meow", "hen": "cluck", "lion": "roar", "dragon": "roar",
                 "horse": "neigh", "goat": "baa"}

TOYS = ("ball", "kite", "doll", "toy car", "teddy bear", "drum", "yo-yo", "toy boat",
        "puzzle", "jump rope", "little train", "wooden horse", "spinning top", "robot")
THINGS = ("box", "hat", "book", "cup", "apple", "cake", "flower", "rock", "shell", "key",
          "map", "coin", "leaf", "feather", "stick", "blanket", "basket", "lamp", "bell",
          "ribbon", "cookie", "pencil", "bucket", "scarf", "stone", "jar", "crown")
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown",
          "golden", "silver", "black")
ADJECTIVES = ("big", "small", "shiny", "soft", "old", "new", "little", "pretty", "funny",
              "round", "tiny", "warm", "bright", "special", "fluffy", "strong")
PLACES = ("park", "garden", "forest", "beach", "river", "hill", "farm", "school", "kitchen",
          "town", "lake", "meadow", "zoo", "yard", "market", "library", "pond", "field",
          "playground", "woods", "house", "barn")
TIMES = ("One day", "One sunny day", "One morning", "One rainy day", "One evening",
         "One cold morning", "One warm afternoon", "One windy day", "Last summer",
         "One snowy day", "Early one morning", "One bright spring day")
GOOD_FEELINGS = ("happy", "glad", "proud", "excited", "calm", "thankful", "joyful")
BAD_FEELINGS = ("sad", "scared", "worried", "upset", "lonely", "tired", "angry")
ACTIVITIES = ("play with blocks", "run in the grass", "draw pictures", "sing songs",
              "read books", "climb trees", "splash in puddles", "look at the clouds",
              "build sand castles", "pick flowers", "dance in the sun", "bake cookies",
              "ride a bike", "fly a kite", "swim in the lake", "play hide and seek",
              "look for bugs", "help in the garden", "paint with bright colors",
              "watch the birds", "jump on the bed", "play in the snow")
HELPERS = ("mom", "dad", "grandma", "grandpa", "big sister", "big brother", "teacher",
           "friend", "aunt", "uncle")
FOODS = ("apples", "bread", "soup", "cookies", "cake", "pie", "carrots", "berries",
         "cheese", "pancakes", "milk", "honey", "rice", "eggs")
LESSONS = (
    "sharing makes everyone happy",
    "it is good to help others",
    "being kind is always the right thing to do",
    "friends are better than toys",
    "it is okay to ask for help",
    "being brave does not mean you are not scared",
    "saying sorry can fix a lot of things",
    "listening to others is important",
    "working together makes hard jobs easy",
    "you should always tell the truth",
    "patience brings good things",
    "it is fun to try new things",
)

# topic -> (the answer's first sentence, further facts). Chat answers start with the
# first sentence and add a few of the facts in a seeded order.
FACTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "the sea": ("The sea is a very big body of salty water.", (
        "It covers most of the Earth.", "Many fish, whales and crabs live in the sea.",
        "Waves move across the top of the sea all day and all night.",
        "Boats and big ships sail on the sea.", "The sea looks blue because it shows the sky.",
        "People like to swim in the sea on hot summer days.",
        "At the beach, the sea meets the sand.")),
    "the sun": ("The sun is a star that is very close to us.", (
        "It gives us light and keeps us warm.", "The sun rises in the morning and sets in the evening.",
        "Plants need the sun to grow.", "The sun is very, very hot.",
        "You should never look right at the sun.", "The Earth goes around the sun once a year.")),
    "the moon": ("The moon is a big round rock that goes around the Earth.", (
        "We can see it best at night.", "The moon has no light of its own.",
        "It shines because the sun lights it up.", "Sometimes the moon looks round and full.",
        "Sometimes it looks thin like a smile.", "People have walked on the moon.")),
    "the stars": ("Stars are huge balls of hot gas far away in the sky.", (
        "At night we can see many stars twinkle.", "The sun is a star too.",
        "Some stars make shapes in the sky.", "Stars look small because they are so far away.",
        "On a clear night you can see thousands of stars.")),
    "rain": ("Rain is water that falls from the clouds.", (
        "Plants and trees need rain to grow.", "After the rain, there are puddles on the ground.",
        "Sometimes a rainbow comes out after the rain.", "People use umbrellas to stay dry in the rain.",
        "Rain fills the rivers and the lakes.")),
    "snow": ("Snow is made of tiny pieces of ice that fall from the clouds.", (
        "Snow falls when it is very cold.", "Snow is white and soft.",
        "Children like to build snowmen in the snow.", "Every snowflake has six sides.",
        "When the sun comes out, the snow melts into water.")),
    "the wind": ("Wind is air that moves.", (
        "You cannot see the wind, but you can feel it.", "The wind makes the leaves dance.",
        "A strong wind can blow a hat away.", "The wind helps kites fly high in the sky.",
        "Sailboats use the wind to move on the water.")),
    "trees": ("Trees are tall plants with a trunk, branches and leaves.", (
        "Trees give us shade on sunny days.", "Birds build their nests in trees.",
        "Some trees grow apples, pears or nuts.", "Trees make the air clean.",
        "In autumn, many trees lose their leaves.", "A tree can live for hundreds of years.")),
    "flowers": ("Flowers are the pretty parts of many plants.", (
        "They come in many colors, like red, yellow and purple.", "Bees visit flowers to get nectar.",
        "Many flowers smell sweet.", "Flowers need sun and water to grow.",
        "Some flowers close at night and open in the morning.")),
    "birds": ("Birds are animals with feathers and wings.", (
        "Most birds can fly.", "Birds lay eggs in nests.", "Many birds sing in the morning.",
        "Some birds fly far away when winter comes.", "Penguins are birds that cannot fly, but they swim well.")),
    "fish": ("Fish are animals that live in water.", (
        "They breathe with gills.", "Fish use their fins and tails to swim.",
        "Some fish live in rivers and some live in the sea.", "Fish come in many colors and sizes.",
        "Many fish swim together in a group called a school.")),
    "cats": ("Cats are small, soft animals that many people keep as pets.", (
        "Cats like to sleep a lot.", "A happy cat purrs.", "Cats can see well in the dark.",
        "Cats have sharp claws and long whiskers.", "Cats like to chase balls and strings.")),
    "dogs": ("Dogs are friendly animals and good friends to people.", (
        "Dogs like to run and play.", "A happy dog wags its tail.", "Dogs have a very good nose.",
        "Some dogs help people, like farmers and police.", "Dogs need walks every day.")),
    "horses": ("Horses are big, strong animals with long legs.", (
        "Horses can run very fast.", "People ride horses.", "Horses eat grass, hay and apples.",
        "A baby horse is called a foal.", "Horses sleep standing up.")),
    "bees": ("Bees are small insects that fly from flower to flower.", (
        "Bees make honey.", "Bees live together in a hive.", "Bees help flowers and fruit grow.",
        "A bee can sting, so it is best to leave it alone.", "Bees buzz when they fly.")),
    "frogs": ("Frogs are small green animals that live near water.", (
        "Frogs can jump very far.", "Frogs catch bugs with their long tongues.",
        "A baby frog is called a tadpole.", "Frogs say ribbit.", "Frogs can swim and live on land.")),
    "rabbits": ("Rabbits are small animals with long ears and soft fur.", (
        "Rabbits hop on their strong back legs.", "Rabbits like to eat carrots and grass.",
        "Rabbits live in holes in the ground.", "A rabbit has a short, fluffy tail.")),
    "owls": ("Owls are birds that are awake at night.", (
        "Owls have big eyes and see well in the dark.", "An owl says hoot.",
        "Owls can turn their heads very far.", "Owls fly without making a sound.")),
    "bears": ("Bears are big, strong animals with thick fur.", (
        "Bears live in forests and mountains.", "Bears like to eat berries, fish and honey.",
        "Many bears sleep all winter long.", "A baby bear is called a cub.")),
    "mountains": ("Mountains are very tall hills made of rock.", (
        "Some mountains have snow on top all year.", "It is cold at the top of a mountain.",
        "People climb mountains to see far away.", "Rivers often start high up in the mountains.")),
    "rivers": ("A river is water that flows across the land.", (
        "Rivers flow from the hills down to the sea.", "Fish and frogs live in rivers.",
        "People build bridges to cross rivers.", "Some rivers are small and some are very wide.")),
    "the forest": ("A forest is a place with many, many trees.", (
        "Many animals live in the forest, like deer, foxes and owls.", "The forest is cool and green.",
        "Mushrooms and berries grow in the forest.", "Birds sing in the forest in the morning.")),
    "the farm": ("A farm is a place where people grow food and keep animals.", (
        "Cows, pigs, sheep and hens live on a farm.", "Farmers get up very early.",
        "Farmers grow wheat, corn and vegetables.", "Cows give milk and hens give eggs.")),
    "bread": ("Bread is a food made from flour, water and yeast.", (
        "Bakers bake bread in a hot oven.", "Fresh bread smells very good.",
        "People eat bread with butter, jam or cheese.", "Flour is made from wheat that grows on farms.")),
    "apples": ("Apples are sweet fruit that grow on trees.", (
        "Apples can be red, green or yellow.", "People make apple pie and apple juice.",
        "Apples are good for you.", "In autumn, people pick apples from the trees.")),
    "the garden": ("A garden is a place where people grow plants.", (
        "Flowers, vegetables and herbs grow in a garden.", "A garden needs water, sun and care.",
        "Bees and butterflies visit the garden.", "Children like to dig in the soft dirt.")),
    "school": ("School is a place where children learn.", (
        "Teachers help children read, write and count.", "At school, children make new friends.",
        "Children play outside at break time.", "Many schools have a library full of books.")),
    "friends": ("Friends are people who like you and care about you.", (
        "Friends play together and help each other.", "Good friends share and take turns.",
        "A friend listens when you are sad.", "It is fun to laugh with friends.")),
    "books": ("Books are full of words and pictures.", (
        "Books can tell stories or teach us new things.", "You can find many books in a library.",
        "Reading a book before bed is fun.", "Some books have pictures of animals and faraway places.")),
    "music": ("Music is sound that people make to feel happy, calm or excited.", (
        "People sing songs and play drums, pianos and guitars.", "Music can make you want to dance.",
        "Birds make music when they sing.", "Many children learn songs at school.")),
    "the sky": ("The sky is the air high above us.", (
        "On a sunny day the sky is blue.", "At night the sky is dark and full of stars.",
        "Clouds float across the sky.", "At sunset the sky turns orange and pink.")),
    "winter": ("Winter is the coldest time of the year.", (
        "In winter it can snow.", "People wear warm coats, hats and scarves.",
        "The days are short and the nights are long.", "Children like to play in the snow.")),
    "summer": ("Summer is the warmest time of the year.", (
        "In summer the days are long and sunny.", "People go to the beach and swim.",
        "Children eat ice cream to stay cool.", "Many fruits are ready to pick in summer.")),
    "spring": ("Spring is the time of year when plants start to grow again.", (
        "In spring the flowers open and the trees get new leaves.", "Baby birds hatch in spring.",
        "The days get warmer and longer.", "Spring often brings rain.")),
    "autumn": ("Autumn is the time of year after summer.", (
        "In autumn the leaves turn red, orange and yellow.", "The leaves fall from the trees.",
        "People pick apples and pumpkins.", "The air gets cool and windy.")),
    "the night": ("Night is the time when the sun is gone and the sky is dark.", (
        "At night most people sleep.", "The moon and the stars come out at night.",
        "Owls and bats are awake at night.", "It is quiet at night.")),
    "boats": ("Boats are things that float and carry people on water.", (
        "Some boats have sails and use the wind.", "Some boats have motors.",
        "Fishing boats go out to catch fish.", "Big boats are called ships.")),
    "trains": ("Trains are long machines that run on tracks.", (
        "Trains carry people and things from town to town.", "A train has many cars.",
        "Trains can go very fast.", "Trains stop at a station.")),
    "rainbows": ("A rainbow is a band of colors in the sky.", (
        "You can see a rainbow when the sun shines after rain.", "A rainbow has red, orange, yellow, green, blue and purple.",
        "Rainbows are made when light shines through drops of water.", "A rainbow looks like a big bow in the sky.")),
    "clouds": ("Clouds are made of tiny drops of water in the sky.", (
        "Some clouds are white and fluffy.", "Dark gray clouds often bring rain.",
        "Clouds can look like animals and other shapes.", "Clouds move when the wind blows.")),
}
